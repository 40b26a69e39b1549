"""Random interleavings of the request API on a tiny pool: block accounting and outputs stay exact."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdd.engine import Engine, EngineConfig, SamplingParams, tiny_model

CKPT = tiny_model(61, num_layers=1, num_heads=4, num_kv_heads=2)
BASE = [7, 3, 9, 1, 5, 11, 2, 8, 4, 6, 10, 12]  # shared prefix, so the radix cache gets hits
_reference: dict[tuple[int, ...], list[int]] = {}


def reference(prompt: list[int], n: int) -> list[int]:
    key = tuple(prompt)
    if key not in _reference or len(_reference[key]) < n:
        (_reference[key],) = Engine(CKPT, EngineConfig(num_blocks=64)).generate(
            [prompt], SamplingParams(max_tokens=24)
        )
    return _reference[key][:n]


def record(step_outputs, outputs: dict[str, list[int]]) -> None:
    for o in step_outputs:
        if o.token_id is None:  # finished on appended tokens: nothing new
            assert o.finished and o.position == len(outputs[o.request_id]) - 1
        else:
            assert o.position == len(outputs[o.request_id])
            outputs[o.request_id].append(o.token_id)


@settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.integers(0, 2**32 - 1))
def test_random_operation_sequences_keep_invariants_and_outputs(llama_oracle, seed):
    rng = random.Random(seed)
    engine = Engine(
        CKPT,
        EngineConfig(
            num_blocks=rng.randint(9, 14),
            block_size=4,
            max_num_batched_tokens=rng.choice([3, 8, 64]),
            max_num_seqs=rng.randint(1, 4),
        ),
    )
    prompts, outputs, aborted, paused, max_tokens = {}, {}, set(), set(), {}
    for op in range(40):
        kind = rng.random()
        live = [r for r in prompts if engine.holds_request(r) and r not in aborted]
        if kind < 0.25 and len(prompts) < 8:
            rid = f"r{op}"
            prompts[rid] = BASE[: rng.randint(1, len(BASE))] + [
                rng.randrange(256) for _ in range(rng.randint(0, 6))
            ]
            outputs[rid] = []
            max_tokens[rid] = rng.randint(1, 20)
            engine.add_request(rid, prompts[rid], SamplingParams(max_tokens=max_tokens[rid]))
        elif kind < 0.3 and live:
            rid = rng.choice(live)
            engine.abort(rid)
            aborted.add(rid)
            paused.discard(rid)
        elif kind < 0.4 and live:
            rid = rng.choice(live)
            (engine.resume if rid in paused else engine.pause)(rid)
            paused ^= {rid}
        elif kind < 0.5 and live:  # extend with the tokens the request would produce anyway
            rid = rng.choice(live)
            m = len(outputs[rid])
            start = rng.choice([m, max(0, m - 1)])  # at the end, or overlapping the last output
            tokens = reference(prompts[rid], max_tokens[rid])[start : start + rng.randint(1, 5)]
            if tokens:
                engine.append_tokens(rid, tokens, start=start)
                outputs[rid] = (
                    outputs[rid][:start] + tokens if start + len(tokens) > m else outputs[rid]
                )
        else:
            if kind > 0.9:
                for rid in list(paused):
                    engine.resume(rid)
                paused.clear()
            record(engine.step(), outputs)
        engine.check_integrity()
    for rid in list(paused):
        engine.resume(rid)
    while engine.has_unfinished():
        record(engine.step(), outputs)
        engine.check_integrity()
    oracle = llama_oracle(CKPT)
    for rid, out in outputs.items():
        if rid not in aborted:
            oracle.assert_greedy_equal(
                prompts[rid], out, reference=reference(prompts[rid], len(out))
            )
    used, total = engine.kv_usage()
    assert used == engine.blocks.cache.cached_blocks == engine.blocks.cache.evictable_blocks
