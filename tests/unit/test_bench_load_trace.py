"""``pdd bench --trace``: our traces as they are, Mooncake traces recognised and mapped."""

from __future__ import annotations

import json

import pytest

from pdd.bench.mooncake import MooncakeConfig, load_mooncake
from pdd.bench.runner import load_trace
from pdd.bench.trace import TraceConfig, generate, write_trace

ROWS = [
    {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]},
    {"timestamp": 5, "input_length": 1024, "output_length": 3, "hash_ids": [1, 3]},
]


def test_a_mooncake_trace_is_mapped_as_pdd_trace_mooncake_maps_it(tmp_path, capsys):
    src = tmp_path / "mc.jsonl"
    src.write_text("\n" + "\n".join(json.dumps(r) for r in ROWS) + "\n")  # a blank first line
    got = load_trace(src, block_tokens=8)
    assert got == load_mooncake(src, MooncakeConfig(block_tokens=8))
    assert [r.request_id for r in got] == ["mc-000000", "mc-000001"]
    err = capsys.readouterr().err
    assert "a Mooncake trace" in err and "8 tokens per hash block" in err
    # --mooncake says so up front: the same requests, and nothing to announce.
    assert load_trace(src, mooncake=True, block_tokens=8) == got
    assert capsys.readouterr().err == ""


def test_our_trace_is_read_as_it_is(tmp_path, capsys):
    trace = generate(TraceConfig(sessions=2, turns=2, prompt_tokens=32, max_context_tokens=128))
    write_trace(trace, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == trace
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "row,field",
    [
        ({"timestamp": "soon", "input_length": 1, "output_length": 1, "hash_ids": []}, "timestamp"),
        ({"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": []}, "input_length"),
        (
            {"timestamp": 0, "input_length": 1, "output_length": 1.5, "hash_ids": []},
            "output_length",
        ),
        (
            {"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1, None]},
            "hash_ids",
        ),
    ],
)
def test_a_bad_mooncake_line_names_file_line_and_field(row, field, tmp_path):
    src = tmp_path / "mc.jsonl"
    src.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=rf"^{src}:2: {field}: "):
        load_trace(src)
