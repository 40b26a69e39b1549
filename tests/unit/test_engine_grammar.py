"""Structured output on the real SmolLM2 tokenizer: JSON that parses, across a handoff and a rollback.

The grammar masks what each step may sample; the matcher must follow every output, also
tokens another engine produced (``append_tokens``) and a rollback of speculative ones.
"""

from __future__ import annotations

import json

import pytest

from pdd.engine import Engine, EngineConfig, SamplingParams, tiny_model
from pdd.engine.grammar import from_json_schema
from pdd.serving.model_spec import load_model

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}
QUESTION = [{"role": "user", "content": "Give the capital of France and its population as JSON."}]


@pytest.fixture(scope="module")
def ckpt():
    return load_model("smollm2")


@pytest.fixture(scope="module")
def prompt(ckpt):
    return list(
        ckpt.tokenizer.apply_chat_template(
            QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def engine(ckpt, **kw) -> Engine:
    return Engine(ckpt, EngineConfig(kv_cache_bytes=32 * 2**20, **kw))


def steps(e: Engine, rid: str) -> list:
    out = []
    while e.has_unfinished():
        out += [o for o in e.step() if o.request_id == rid]
    return out


def parsed(ckpt, tokens) -> dict:
    value = json.loads(ckpt.tokenizer.decode(tokens, skip_special_tokens=True))
    assert (
        isinstance(value, dict)
        and isinstance(value["city"], str)
        and isinstance(value["population"], int)
    )
    return value


def test_output_follows_the_schema_and_plain_output_does_not(ckpt, prompt):
    grammar = from_json_schema(SCHEMA)
    e = engine(ckpt)
    (plain,) = e.generate([prompt], SamplingParams(max_tokens=30))
    with pytest.raises(ValueError):
        json.loads(
            ckpt.tokenizer.decode(plain, skip_special_tokens=True)
        )  # the model alone writes markdown
    e.add_request("r", prompt, SamplingParams(max_tokens=60, grammar=grammar))
    outs = steps(e, "r")
    parsed(ckpt, [o.token_id for o in outs if o.token_id is not None])
    assert outs[-1].finish_reason == "stop"
    # seeded sampling stays in the grammar too
    (hot,) = e.generate(
        [prompt], SamplingParams(max_tokens=60, grammar=grammar, temperature=1.0, seed=5)
    )
    parsed(ckpt, hot)


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(ckpt, prompt):
    grammar = from_json_schema(
        {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        }
    )
    e = engine(ckpt)
    e.add_request("r", prompt, SamplingParams(max_tokens=50, grammar=grammar, ignore_eos=True))
    outs = steps(e, "r")
    assert json.loads(
        ckpt.tokenizer.decode([o.token_id for o in outs], skip_special_tokens=True)
    ) in ({"ok": True}, {"ok": False})
    assert outs[-1].finish_reason == "stop" and len(outs) < 50


def test_handoff_and_rollback_keep_the_matcher_in_step(ckpt, prompt):
    """Relay → MainDecode: the relay's tokens reach MainDecode's matcher; MainDecode's own tokens
    computed ahead and then replaced roll it back — the output equals one engine's."""
    sp = SamplingParams(max_tokens=60, grammar=from_json_schema(SCHEMA), temperature=1.0, seed=11)
    md = engine(ckpt)
    (reference,) = md.generate([prompt], sp)
    detour = ckpt.tokenizer.encode(
        '{"city":"Lyon', add_special_tokens=False
    )  # valid, and not the reference
    assert detour[:4] != reference[:4]
    md.add_request("r", prompt, sp)
    ahead = [o.token_id for _ in range(6) for o in md.step()]  # speculative: MainDecode ran ahead
    assert ahead == reference[:6]
    # a stale round replaces them with another valid prefix, then the real one replaces that
    assert md.append_tokens("r", detour[:4], 0)
    assert md.append_tokens("r", reference[:8], 0)
    rest = [o.token_id for o in steps(md, "r") if o.token_id is not None]
    assert reference[:8] + rest == reference


def test_tokens_outside_the_grammar_are_refused_and_change_nothing(ckpt, prompt):
    sp = SamplingParams(max_tokens=60, grammar=from_json_schema(SCHEMA))
    e = engine(ckpt)
    (reference,) = e.generate([prompt], sp)
    e.add_request("r", prompt, sp)
    e.append_tokens("r", reference[:3], 0)
    bad = ckpt.tokenizer.encode(
        "\n", add_special_tokens=False
    )  # JSON allows it nowhere (compact, or raw in a string)
    with pytest.raises(ValueError, match="grammar"):
        e.append_tokens("r", reference[3:5] + bad, 3)
    rest = [o.token_id for o in steps(e, "r") if o.token_id is not None]
    assert reference[:3] + rest == reference


def test_grammar_needs_a_tokenizer_and_must_compile(ckpt, prompt):
    with pytest.raises(ValueError, match="grammar"):
        Engine(tiny_model(3), EngineConfig(num_blocks=16)).add_request(
            "r", [1, 2], SamplingParams(grammar='start: "a"')
        )
    with pytest.raises(ValueError, match="grammar"):
        engine(ckpt).add_request(
            "r", prompt, SamplingParams(grammar='{"grammars": [{"json_schema": {"type": 7}}]}')
        )
