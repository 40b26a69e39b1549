"""KV export/import in the wire format: prefill on one engine, decode on another."""

from __future__ import annotations

import random

import pytest
import torch

from pdd.engine import (
    Engine,
    EngineConfig,
    KvPayload,
    SamplingParams,
    from_bytes,
    tiny_model,
    to_bytes,
)

CKPT = tiny_model(31, num_layers=2, num_heads=4, num_kv_heads=2)
PEAKED = tiny_model(32, num_layers=2, num_heads=4, num_kv_heads=2, tie_word_embeddings=True)
rng = random.Random(7)
PROMPT = [rng.randrange(256) for _ in range(37)]
N = 16


def prefill(ckpt, prompt, config=None, chunks=(0,)) -> tuple[int, list[KvPayload]]:
    """The prefill service's use: max_tokens=1, keep the KV, export ranges, release."""
    p = Engine(ckpt, config or EngineConfig(num_blocks=32))
    p.add_request("r", prompt, SamplingParams(max_tokens=1), keep_after_finish=True)
    outs = []
    while not outs:
        outs = p.step()
    assert outs[0].finished and p.holds_request("r")
    bounds = list(chunks) + [len(prompt)]
    payloads = [from_bytes(to_bytes(p.export_kv("r", a, b))) for a, b in zip(bounds, bounds[1:])]
    p.release("r")
    assert not p.holds_request("r")
    return outs[0].token_id, payloads


def decode_with(md: Engine, prompt, first_token, payloads) -> list[int]:
    md.add_request("r", prompt, SamplingParams(max_tokens=N), paused=True)
    for payload in payloads:
        md.import_kv("r", payload)
    assert md.num_cached_tokens("r") == len(prompt)
    md.append_tokens("r", [first_token])
    md.resume("r")
    out = [first_token]
    while md.has_unfinished():
        out += [o.token_id for o in md.step()]
    return out


def reference(ckpt, prompt) -> list[int]:
    return Engine(ckpt, EngineConfig(num_blocks=32)).generate(
        [prompt], SamplingParams(max_tokens=N)
    )[0]


def test_fp32_transfer_is_token_identical():
    first, payloads = prefill(CKPT, PROMPT, chunks=(0, 16))  # streamed in two chunks
    out = decode_with(Engine(CKPT, EngineConfig(num_blocks=32)), PROMPT, first, payloads)
    assert out == reference(CKPT, PROMPT)


def test_receiver_with_another_block_size(llama_oracle):
    first, payloads = prefill(CKPT, PROMPT, EngineConfig(num_blocks=32, block_size=16))
    assert payloads[0].descriptor.block_size == 16
    out = decode_with(
        Engine(CKPT, EngineConfig(num_blocks=64, block_size=4)), PROMPT, first, payloads
    )
    # same float32 numbers, only padded to another key length: equal up to a near-tie
    llama_oracle(CKPT).assert_greedy_equal(PROMPT, out, reference=reference(CKPT, PROMPT))


def test_fp32_to_bf16_receiver():
    """A bfloat16 receiver converts on import. Its own decode runs in bf16, so equality to the fp32
    original is asserted on a model with strongly peaked logits (tied embeddings, margins ~1 logit),
    where bf16 rounding cannot flip a choice; the conversion itself is checked to be exact rounding."""
    first, payloads = prefill(PEAKED, PROMPT)
    wire = payloads[0].to_tensor()
    assert wire.dtype == torch.float32
    md = Engine(PEAKED, EngineConfig(num_blocks=32, dtype="bfloat16"))
    md.add_request("probe", PROMPT, SamplingParams(max_tokens=1), paused=True)
    md.import_kv("probe", payloads[0])
    stored = md.export_kv("probe", 0, len(PROMPT))
    assert stored.descriptor.dtype == "bfloat16"
    assert torch.equal(stored.to_tensor(), wire.to(torch.bfloat16))
    md.abort("probe")
    assert decode_with(md, PROMPT, first, payloads) == reference(PEAKED, PROMPT)


def test_bf16_on_the_wire_to_fp32_receiver(llama_oracle):
    p = Engine(PEAKED, EngineConfig(num_blocks=32))
    p.add_request("r", PROMPT, SamplingParams(max_tokens=1), keep_after_finish=True)
    (first,) = p.step()
    full = p.export_kv("r", 0, len(PROMPT))
    small = p.export_kv("r", 0, len(PROMPT), dtype="bfloat16")
    assert small.descriptor.dtype == "bfloat16" and len(small.data) * 2 == len(full.data)
    out = decode_with(Engine(PEAKED, EngineConfig(num_blocks=32)), PROMPT, first.token_id, [small])
    assert out == reference(PEAKED, PROMPT)


def test_only_the_delta_is_sent_to_a_receiver_holding_the_prefix():
    """Decode-side radix cache: the receiver served the previous turn, P sends only what it lacks."""
    md = Engine(CKPT, EngineConfig(num_blocks=64, block_size=8))
    (turn1,) = md.generate([PROMPT], SamplingParams(max_tokens=N))
    prompt2 = PROMPT + turn1 + [3, 1, 4, 1, 5, 9, 2, 6]
    md.add_request("r", prompt2, SamplingParams(max_tokens=N), paused=True)
    hit = md.num_cached_tokens("r")
    assert hit == (len(PROMPT) + N - 1) // 8 * 8 > 0
    first, payloads = prefill(CKPT, prompt2, chunks=(hit,))
    assert payloads[0].start_token == hit and payloads[0].num_tokens == len(prompt2) - hit
    md.import_kv("r", payloads[0])
    md.append_tokens("r", [first])
    md.resume("r")
    out = [first]
    while md.has_unfinished():
        out += [o.token_id for o in md.step()]
    assert out == reference(CKPT, prompt2)


def test_wire_format_round_trip_and_validation():
    first, (payload,) = prefill(CKPT, PROMPT)
    d = payload.descriptor
    assert (
        d.layout,
        d.dtype,
        d.num_layers,
        d.num_kv_heads,
        d.head_dim,
        d.start_token,
        d.num_tokens,
    ) == ("layer,kv,token,head,dim", "float32", 2, 2, 16, 0, len(PROMPT))
    blob = to_bytes(payload)
    assert from_bytes(blob) == payload
    with pytest.raises(ValueError, match="magic"):
        from_bytes(b"XX" + blob)
    with pytest.raises(ValueError, match="bytes"):
        from_bytes(blob[:-4])
    md = Engine(CKPT, EngineConfig(num_blocks=32))
    md.add_request("r", PROMPT, SamplingParams(max_tokens=4), paused=True)
    later = KvPayload.from_tensor(payload.to_tensor()[:, :, 10:], start_token=10, block_size=16)
    with pytest.raises(ValueError, match="only 0 tokens"):
        md.import_kv("r", later)  # tokens 0..9 have no K/V yet
    other = Engine(tiny_model(1, num_layers=3), EngineConfig(num_blocks=32))
    other.add_request("r", PROMPT, SamplingParams(max_tokens=4), paused=True)
    with pytest.raises(ValueError, match="does not match"):
        other.import_kv("r", payload)
    with pytest.raises(ValueError, match="outside"):
        md.export_kv("r", 0, 5)


def test_receiver_samples_the_first_token_itself_without_touching_cached_blocks():
    """All prompt K/V imported (and its full blocks cached): the engine recomputes only the last
    token for its logits, writing that token's K/V to scratch, never into a shared cached block."""
    prompt = PROMPT[:32]  # exactly two blocks of 16
    _, payloads = prefill(CKPT, prompt)
    md = Engine(CKPT, EngineConfig(num_blocks=32))
    md.add_request("r", prompt, SamplingParams(max_tokens=N), paused=True, keep_after_finish=True)
    md.import_kv("r", payloads[0])
    assert md.prefix_match_len(prompt) == 32  # the imported blocks are shared right away
    before = md.export_kv("r", 0, 32).data
    md.resume("r")
    out = []
    while md.has_unfinished():
        out += [o.token_id for o in md.step()]
    assert out == reference(CKPT, prompt)
    assert md.export_kv("r", 0, 32).data == before
