"""Logit bias and presence, frequency, repetition penalties: the math, the oracle, a handoff in the middle.

Oracle for repetition: transformers' own ``repetition_penalty`` (it too penalizes prompt and
generated tokens). For presence/frequency (transformers has none): greedy decoding of the oracle's
logits with the penalties applied in the test, step by step.
"""

from __future__ import annotations

import pytest
import torch

from pdd.engine import Engine, EngineConfig, SamplingParams, tiny_model
from pdd.engine.sampling import adjust_logits, sample

CKPT = tiny_model(43, num_layers=2, num_heads=4, num_kv_heads=2, std=0.05)
PROMPTS = [[12, 200, 3, 45, 6, 78, 9], [5, 5, 5, 7, 100, 101, 102, 5, 7]]


@pytest.mark.parametrize(
    "bad",
    [
        dict(presence_penalty=2.5),
        dict(presence_penalty=float("nan")),
        dict(frequency_penalty=-2.01),
        dict(repetition_penalty=0.0),
        dict(repetition_penalty=-1.0),
        dict(repetition_penalty=float("inf")),
        dict(logit_bias={3: 100.5}),
        dict(logit_bias={-1: 1.0}),
        dict(logit_bias=((3, 1.0), (3, 2.0))),
        dict(logit_bias={2: float("nan")}),
    ],
)
def test_penalty_validation(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_logit_bias_is_normalised_to_sorted_pairs():
    sp = SamplingParams(logit_bias={9: -1, 2: 0.5})
    assert sp.logit_bias == ((2, 0.5), (9, -1.0)) and sp.adjusts_logits and not sp.penalized
    assert SamplingParams(logit_bias=[(9, -1.0), (2, 0.5)]) == sp


def test_penalized_is_off_only_at_the_neutral_values():
    assert not SamplingParams().adjusts_logits
    assert (
        SamplingParams(presence_penalty=0.1).adjusts_logits
        and SamplingParams(frequency_penalty=-0.1).adjusts_logits
    )
    assert SamplingParams(repetition_penalty=1.1).adjusts_logits


def test_penalty_math_on_known_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    out = adjust_logits(logits, [(sp, [0, 1], [3, 3, 4]), None])
    # token 0: prompt → repetition only (2/2); 1: prompt, negative → -1*2; 2 untouched;
    # 3: output twice → 3/2 - 2*0.25 - 0.5; 4: output once, negative → -2*2 - 0.25 - 0.5; 5 untouched
    assert out[0].tolist() == pytest.approx([1.0, -2.0, 0.5, 0.5, -4.75, 1.0])
    assert torch.equal(out[1], logits[1])  # a row without penalties is left as it is
    assert logits[0, 0] == 2.0  # the input is not changed


def test_logit_bias_comes_before_the_penalties():
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    sp = SamplingParams(repetition_penalty=2.0, logit_bias={0: 2.0, 1: -3.0, 2: 1.0})
    # bias first: [4, -4, 1.5]; then repetition over tokens 0 and 2 (in the prompt): [2, -4, 0.75]
    assert adjust_logits(logits, [(sp, [0, 2], [])])[0].tolist() == pytest.approx([2.0, -4.0, 0.75])


def test_greedy_with_penalties_turns_away_from_a_repeated_token():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    plain = sample(logits, [SamplingParams()], [0], [0])
    sp = SamplingParams(presence_penalty=0.2)
    assert plain == [0] and sample(adjust_logits(logits, [(sp, [], [0])]), [sp], [0], [0]) == [1]


def run(engine: Engine, prompt, sp, rid: str = "r") -> list[int]:
    engine.add_request(rid, prompt, sp)
    out = []
    while engine.has_unfinished():
        out += [o.token_id for o in engine.step() if o.request_id == rid]
    return out


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(llama_oracle, penalty):
    oracle = llama_oracle(CKPT)
    sp = SamplingParams(max_tokens=20, repetition_penalty=penalty, ignore_eos=True)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            want = oracle.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=20,
                min_new_tokens=20,
                do_sample=False,
                pad_token_id=0,
                repetition_penalty=penalty,
            )[0, len(prompt) :].tolist()
        ours = run(Engine(CKPT, EngineConfig(num_blocks=64)), prompt, sp)
        oracle.assert_greedy_equal(prompt, ours, want)


def test_presence_and_frequency_match_the_oracle_penalized_by_hand(llama_oracle):
    oracle = llama_oracle(CKPT)
    sp = SamplingParams(
        max_tokens=20,
        presence_penalty=0.8,
        frequency_penalty=0.6,
        repetition_penalty=1.2,
        ignore_eos=True,
    )
    for prompt in PROMPTS:
        outputs: list[int] = []
        for _ in range(20):
            row = oracle.next_logits(prompt + outputs)[None]
            outputs.append(int(adjust_logits(row, [(sp, prompt, outputs)])[0].argmax()))
        plain = run(
            Engine(CKPT, EngineConfig(num_blocks=64)),
            prompt,
            SamplingParams(max_tokens=20, ignore_eos=True),
        )
        assert outputs != plain, "the penalties should change this greedy output"
        oracle.assert_greedy_equal(
            prompt, run(Engine(CKPT, EngineConfig(num_blocks=64)), prompt, sp), outputs
        )


def test_logit_bias_bans_and_forces_tokens():
    plain = run(
        Engine(CKPT, EngineConfig(num_blocks=64)),
        PROMPTS[0],
        SamplingParams(max_tokens=12, ignore_eos=True),
    )
    banned = {t: -100.0 for t in set(plain)}
    ours = run(
        Engine(CKPT, EngineConfig(num_blocks=64)),
        PROMPTS[0],
        SamplingParams(max_tokens=12, ignore_eos=True, logit_bias=banned),
    )
    assert not set(ours) & set(plain)
    forced = run(
        Engine(CKPT, EngineConfig(num_blocks=64)),
        PROMPTS[0],
        SamplingParams(
            max_tokens=5, ignore_eos=True, temperature=1.0, seed=1, logit_bias={77: 100.0}
        ),
    )
    assert forced == [77] * 5
    engine = Engine(CKPT, EngineConfig(num_blocks=64))
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request(
            "r", PROMPTS[0], SamplingParams(logit_bias={engine.model_config.vocab_size: 1.0})
        )


def test_penalties_survive_a_handoff_and_a_busy_batch():
    """Relay → MainDecode as in the service: tokens appended on the second engine count as outputs."""
    sp = SamplingParams(
        max_tokens=24,
        presence_penalty=0.5,
        frequency_penalty=0.4,
        repetition_penalty=1.3,
        temperature=0.9,
        seed=77,
        ignore_eos=True,
        logit_bias={5: -5.0, 100: 2.0},
    )
    prompt = PROMPTS[1]
    (reference,) = Engine(CKPT, EngineConfig(num_blocks=64)).generate([prompt], sp)
    relay = Engine(CKPT, EngineConfig(num_blocks=64))
    relay.add_request("r", prompt, sp, keep_after_finish=True)
    relayed = [o.token_id for _ in range(9) for o in relay.step()]
    md = Engine(CKPT, EngineConfig(num_blocks=96, block_size=8, max_num_batched_tokens=6))
    for i in range(3):  # other requests without penalties in the same batches
        md.add_request(f"o{i}", list(range(i + 1, i + 12)), SamplingParams(max_tokens=12))
    md.add_request("r", prompt, sp, paused=True)
    md.import_kv("r", relay.export_kv("r", 0, len(prompt)))
    md.append_tokens("r", relayed)
    md.resume("r")
    rest = []
    while md.has_unfinished():
        rest += [o.token_id for o in md.step() if o.request_id == "r"]
    assert relayed + rest == reference


def run_logprobs(engine: Engine, prompt, sp, rid: str = "r"):
    engine.add_request(rid, prompt, sp)
    out = []
    while engine.has_unfinished():
        out += [(o.token_id, o.logprob) for o in engine.step() if o.request_id == rid]
    return out


@pytest.mark.parametrize("bad", [dict(logprobs=-1), dict(logprobs=21), dict(logprobs=1.5)])
def test_logprobs_validation(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(**bad)


def test_logprobs_are_the_models_raw_log_softmax(llama_oracle):
    """Each output token's logprob and top-k equal the oracle's log-softmax, whatever the bias,
    penalties and temperature did to the draw (vLLM's raw logprobs)."""
    oracle = llama_oracle(CKPT)
    prompt = PROMPTS[1]
    sp = SamplingParams(
        max_tokens=10,
        temperature=0.8,
        seed=3,
        logprobs=4,
        ignore_eos=True,
        logit_bias={5: 3.0},
        repetition_penalty=1.2,
    )
    engine = Engine(
        CKPT, EngineConfig(num_blocks=64, max_num_batched_tokens=4)
    )  # chunked prefill too
    engine.add_request(
        "other", [9] * 13, SamplingParams(max_tokens=10)
    )  # a batch mate without logprobs
    outs = run_logprobs(engine, prompt, sp)
    tokens = [t for t, _ in outs]
    for i, (token, lp) in enumerate(outs):
        want = torch.log_softmax(oracle.next_logits(prompt + tokens[:i]), dim=-1)
        assert lp.logprob == pytest.approx(float(want[token]), abs=1e-4)
        values, ids = want.topk(4)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)
    assert all(
        lp is None
        for _, lp in run_logprobs(
            Engine(CKPT, EngineConfig(num_blocks=64)), prompt, SamplingParams(max_tokens=3)
        )
    )
    only = run_logprobs(
        Engine(CKPT, EngineConfig(num_blocks=64)), prompt, SamplingParams(max_tokens=3, logprobs=0)
    )
    assert all(lp is not None and lp.top == () and lp.logprob <= 0 for _, lp in only)
