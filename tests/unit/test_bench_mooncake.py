"""Mooncake replay: hash ids become shared token blocks, lengths are honoured, hits are exact."""

from __future__ import annotations

import json

import pytest

from pdd.bench.mooncake import (
    MooncakeConfig,
    block_tokens,
    load_mooncake,
    main,
    read_mooncake,
    to_requests,
)
from pdd.bench.trace import read_trace

ROWS = [
    {"timestamp": 0, "input_length": 1536, "output_length": 40, "hash_ids": [1, 2, 3]},
    {"timestamp": 27, "input_length": 1200, "output_length": 7, "hash_ids": [1, 2, 9]},
    {"timestamp": 10, "input_length": 700, "output_length": 300, "hash_ids": [5, 6]},
]


def test_shared_hash_ids_give_identical_blocks():
    cfg = MooncakeConfig(block_tokens=16)
    reqs = {r.request_id: r for r in to_requests(ROWS, cfg)}
    a, b, c = (
        reqs["mc-000000"].prompt_token_ids,
        reqs["mc-000001"].prompt_token_ids,
        reqs["mc-000002"].prompt_token_ids,
    )
    assert a[:32] == b[:32]  # ids 1, 2 shared
    assert a[32:48] != b[32:48]  # 3 vs 9
    assert a[:16] == block_tokens(1, cfg) and c[:16] == block_tokens(5, cfg)
    assert block_tokens(1, cfg) == block_tokens(1, MooncakeConfig(block_tokens=16))
    assert block_tokens(1, cfg) != block_tokens(1, MooncakeConfig(block_tokens=16, seed=1))


def test_lengths_scale_and_are_honoured():
    cfg = MooncakeConfig(block_tokens=16, output_scale=2.0)
    reqs = {r.request_id: r for r in to_requests(ROWS, cfg)}
    assert [len(reqs[f"mc-00000{i}"].prompt_token_ids) for i in range(3)] == [
        48,
        round(1200 * 16 / 512),
        22,
    ]
    assert [reqs[f"mc-00000{i}"].max_tokens for i in range(3)] == [20, 4, 150]
    full = to_requests(ROWS, MooncakeConfig(block_tokens=512))
    assert sorted(len(r.prompt_token_ids) for r in full) == [700, 1200, 1536]


def test_order_timestamps_and_expected_hits():
    reqs = to_requests(ROWS, MooncakeConfig(block_tokens=16, time_scale=2.0))
    assert [r.request_id for r in reqs] == ["mc-000000", "mc-000002", "mc-000001"]
    assert [r.timestamp_ms for r in reqs] == [0.0, 5.0, 13.5]
    assert [r.expected_hit for r in reqs] == [0.0, 0.0, pytest.approx(32 / 38)]
    assert all(r.session_id == r.request_id and not r.output_slots for r in reqs)


def test_partial_blocks_and_missing_ids():
    rows = [
        {"timestamp": 0, "input_length": 768, "output_length": 1, "hash_ids": [1, 2]},  # 1.5 blocks
        {
            "timestamp": 1,
            "input_length": 1024,
            "output_length": 1,
            "hash_ids": [1, 2],
        },  # 2 full blocks
        {"timestamp": 2, "input_length": 1024, "output_length": 1, "hash_ids": [1]},
    ]  # too few ids
    a, b, c = to_requests(rows, MooncakeConfig(block_tokens=16))
    assert b.prompt_token_ids[:24] == a.prompt_token_ids
    assert b.expected_hit == pytest.approx(24 / 32)  # only the half block a held is shared
    assert len(c.prompt_token_ids) == 32 and c.prompt_token_ids[:16] == a.prompt_token_ids[:16]
    assert c.prompt_token_ids[16:] != b.prompt_token_ids[16:]  # unique filler
    assert c.expected_hit == pytest.approx(0.5)


def test_files_and_cli(tmp_path):
    src = tmp_path / "mooncake.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    assert len(read_mooncake(src)) == 3
    assert (
        main(["mooncake", str(src), "--out", str(tmp_path / "out.jsonl"), "--block-tokens", "8"])
        == 0
    )
    assert read_trace(tmp_path / "out.jsonl") == load_mooncake(src, MooncakeConfig(block_tokens=8))
    (tmp_path / "bad.jsonl").write_text(
        json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1}) + "\n"
    )
    with pytest.raises(ValueError, match="hash_ids"):
        read_mooncake(tmp_path / "bad.jsonl")


@pytest.mark.parametrize(
    "field,value", [("block_tokens", 0), ("time_scale", 0.0), ("vocab_high", 0)]
)
def test_config_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        MooncakeConfig(**{field: value})
