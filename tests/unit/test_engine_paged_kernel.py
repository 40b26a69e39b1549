"""The compiled paged decode kernel against the gather + SDPA path it replaces, op by op and end to end.

The kernel tests need the C++ build: they fail when it fails on a machine with a compiler (a broken
build must not pass silently as a skip) and are skipped only where no C++ compiler exists at all.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys

import pytest
import torch

from pdd.engine import Engine, EngineConfig, SamplingParams, kernels, paged_decode, tiny_model
from pdd.engine.attention import AttentionMetadata, _decode
from pdd.engine.kv_cache import KvCache
from tests.conftest import NEEDS_KERNELS

pytestmark = NEEDS_KERNELS

CKPT = tiny_model(11, num_layers=2, num_heads=8, num_kv_heads=2)


def _reference(q, cache, table, lens) -> torch.Tensor:
    """The engine's fallback decode: gather the blocks, SDPA with a key-length mask."""
    b, mb = table.shape
    length = mb * cache.block_size
    mask = torch.arange(length)[None, :] < lens[:, None]  # [B, L]
    buffer = torch.empty(b * mb, *cache.layer(0).shape[1:])  # [B * MB, bs, 2, KV, D]
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        num_decode=b,
        decode_block_tables=table,
        decode_mask=mask[:, None, None, :],
        decode_gather_buffer=buffer,
    )
    return _decode(q, cache, 0, meta)


def _random_case(
    gen: torch.Generator,
    rng: random.Random,
    batch: int,
    kv: int,
    group: int,
    head_dim: int,
    block_size: int,
):
    """A pool full of random K/V, ``batch`` sequences on disjoint shuffled blocks, ragged lengths."""
    lens = [
        rng.choice([1, block_size, 2 * block_size, 3 * block_size - 1, rng.randint(1, 70)])
        for _ in range(batch)
    ]
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    cache = KvCache(1, num_blocks, block_size, kv, head_dim, torch.float32)
    cache.data.normal_(generator=gen)  # unused blocks and slots hold garbage, not zeros
    ids = list(range(num_blocks + 1))
    rng.shuffle(ids)
    mb = max(need) + rng.randint(0, 2)  # padded past the longest sequence too
    rows = []
    for n in need:
        own, ids = ids[:n], ids[n:]
        rows.append(
            own + [rng.randrange(num_blocks + 1) for _ in range(mb - n)]
        )  # padding → any block
    q = torch.randn(batch, kv * group, head_dim, generator=gen)  # [B, H, D]
    return q, cache, torch.tensor(rows), torch.tensor(lens)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [64, 32, 128])  # 64 and 128 have their own unrolled builds
@pytest.mark.parametrize("block_size", [4, 16])
def test_kernel_matches_gather_and_sdpa(group, head_dim, block_size):
    gen = torch.Generator().manual_seed(group * 1000 + head_dim * 10 + block_size)
    rng = random.Random(group * 7 + head_dim + block_size)
    for batch in (1, 2, 7, 16, 33):
        kv = rng.choice([1, 2, 4])  # small batches are split by KV head across threads
        q, cache, table, lens = _random_case(gen, rng, batch, kv, group, head_dim, block_size)
        ours = paged_decode.paged_decode(q, cache.layer(0), table, lens)
        torch.testing.assert_close(ours, _reference(q, cache, table, lens), rtol=1e-5, atol=1e-5)


def test_result_does_not_depend_on_the_thread_count():
    """Each (sequence, KV heads) item is computed alone, whichever thread the ragged split gives it to."""
    gen = torch.Generator().manual_seed(4)
    before = torch.get_num_threads()
    for batch in (1, 3, 20):
        q, cache, table, lens = _random_case(gen, random.Random(batch), batch, 4, 2, 64, 16)
        outs = []
        try:
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                outs.append(paged_decode.paged_decode(q, cache.layer(0), table, lens))
        finally:
            torch.set_num_threads(before)
        assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_padding_blocks_and_slots_past_the_context_are_never_read():
    """Poisoning every slot past a sequence's length (NaN) changes nothing."""
    gen = torch.Generator().manual_seed(1)
    q, cache, table, lens = _random_case(gen, random.Random(1), 9, 2, 2, 64, 4)
    expected = paged_decode.paged_decode(q, cache.layer(0), table, lens)
    live = torch.zeros(cache.data.shape[1] * cache.block_size, dtype=torch.bool)
    for row, n in zip(table.tolist(), lens.tolist()):
        for pos in range(n):
            live[row[pos // cache.block_size] * cache.block_size + pos % cache.block_size] = True
    cache.data[0].view(-1, 2, 2, 64)[~live] = float("nan")  # [S, 2, KV, D]: every slot not attended
    assert torch.equal(paged_decode.paged_decode(q, cache.layer(0), table, lens), expected)


def test_strided_query_is_read_in_place():
    """The engine passes q as a slice of the fused qkv output: same result as a contiguous copy."""
    gen = torch.Generator().manual_seed(2)
    q, cache, table, lens = _random_case(gen, random.Random(2), 5, 2, 2, 32, 16)
    qkv = torch.cat([q, torch.randn(5, 4, 32, generator=gen)], dim=1)  # [B, H + 2KV, D]
    strided = paged_decode.paged_decode(qkv[:, :4], cache.layer(0), table, lens)
    assert torch.equal(
        strided, paged_decode.paged_decode(q.contiguous(), cache.layer(0), table, lens)
    )


def test_out_of_range_block_or_length_is_an_error():
    gen = torch.Generator().manual_seed(3)
    q, cache, table, lens = _random_case(gen, random.Random(3), 2, 2, 1, 32, 4)
    with pytest.raises(RuntimeError, match="block id"):
        paged_decode.paged_decode(
            q, cache.layer(0), torch.full_like(table, cache.num_blocks + 1), lens
        )
    with pytest.raises(RuntimeError, match="context length"):
        paged_decode.paged_decode(
            q, cache.layer(0), table, torch.full_like(lens, table.shape[1] * 4 + 1)
        )


def test_engine_decodes_the_same_with_and_without_the_kernel(llama_oracle):
    """Token-identical to the gather + SDPA engine, except at an explicit near-tie of the oracle."""
    oracle = llama_oracle(CKPT)
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 45))] for _ in range(7)]
    config = dict(num_blocks=128, block_size=4, max_num_batched_tokens=64)
    with_kernel = Engine(CKPT, EngineConfig(**config))
    without = Engine(CKPT, EngineConfig(**config, paged_decode_kernel=False))
    assert with_kernel.runner.paged_kernel and not without.runner.paged_kernel
    oracle.assert_engines_agree(with_kernel, without, prompts, SamplingParams(max_tokens=24))


def test_env_switch_and_unsupported_pools_fall_back(monkeypatch):
    monkeypatch.setenv(paged_decode.ENV_SWITCH, "0")
    assert not Engine(CKPT, EngineConfig(num_blocks=16)).runner.paged_kernel
    monkeypatch.delenv(paged_decode.ENV_SWITCH)
    assert Engine(CKPT, EngineConfig(num_blocks=16)).runner.paged_kernel
    assert not Engine(CKPT, EngineConfig(num_blocks=16, dtype="bfloat16")).runner.paged_kernel


def test_kernel_decode_step_builds_no_mask_and_no_gather_buffer():
    engine = Engine(CKPT, EngineConfig(num_blocks=32, block_size=4))
    seen = []
    real = engine.model.forward

    def spy(input_ids, cos, sin, cache, meta, rows):
        seen.append(meta)
        return real(input_ids, cos, sin, cache, meta, rows)

    engine.model.forward = spy
    engine.generate([[1, 2, 3], [4, 5, 6, 7, 8]], SamplingParams(max_tokens=3))
    decode = [m for m in seen if m.num_decode]
    assert decode and all(m.decode_mask is None and m.decode_gather_buffer is None for m in decode)
    assert [m.decode_context_lens.tolist() for m in decode] == [[4, 6], [5, 7]]


def test_a_stale_build_lock_does_not_hang_the_next_build(tmp_path):
    """A builder killed mid-build leaves torch's lock file behind; the next process must not wait on it."""
    built = kernels.build_directory()
    shutil.copytree(built, tmp_path / built.name)  # an up-to-date build: ninja has nothing to do
    (tmp_path / built.name / "lock").touch()
    code = "from pdd.engine import kernels; kernels.load(); import torch; print(torch.ops.pdd.paged_decode)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / built.name / "lock").exists()


def test_a_failed_build_falls_back_to_gather_and_sdpa(tmp_path):
    """A compiler that fails: the engine still serves, on the eager paths, and says why."""
    code = (
        "from pdd.engine import Engine, EngineConfig, SamplingParams, tiny_model\n"
        "engine = Engine(tiny_model(11, num_layers=2, num_heads=8, num_kv_heads=2), EngineConfig(num_blocks=16))\n"
        "assert not engine.runner.paged_kernel and not engine.model.fused\n"
        "print('tokens', len(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "false"},
    )
    assert done.returncode == 0, done.stderr
    said = done.stdout + done.stderr
    assert "paged_decode_fallback" in said and "fused_ops_fallback" in said
    assert "build_failed" in said
    assert "tokens 4" in done.stdout
