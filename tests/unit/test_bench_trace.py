"""The agentic trace generator: hit and output-length statistics, real prefix reuse, reproducibility."""

from __future__ import annotations

import numpy as np
import pytest

from pdd.bench.trace import (
    TraceConfig,
    TraceRequest,
    generate,
    main,
    output_buckets,
    poisson_arrivals_ms,
    read_trace,
    sample_hit,
    sample_output_tokens,
    write_trace,
)


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reference_hits(trace: list[TraceRequest]) -> list[float]:
    """Slow and obvious: each prompt's longest common prefix with any earlier prompt + output.

    A request's output is the placeholder its session's next turn carries (the real
    output, once the load generator splices it in).
    """
    outputs = {
        s.request_id: r.prompt_token_ids[s.start : s.start + s.length]
        for r in trace
        for s in r.output_slots
    }
    seqs: list[list[int]] = []
    hits = []
    for r in trace:
        best = max((lcp(r.prompt_token_ids, s) for s in seqs), default=0)
        hits.append(best / len(r.prompt_token_ids))
        seqs.append(r.prompt_token_ids + outputs.get(r.request_id, []))
    return hits


@pytest.mark.parametrize("turns", [3, 6, 10])
def test_skewed_hits_match_the_report(turns):
    trace = generate(
        TraceConfig(
            sessions=240 // turns,
            turns=turns,
            dist="skewed",
            seed=3,
            prompt_tokens=256,
            max_context_tokens=4096,
            output_scale=10,
        )
    )
    hits = np.array([r.expected_hit for r in trace])
    assert 0.68 <= np.mean(hits > 0.95) <= 0.82
    assert hits.mean() == pytest.approx(0.90, abs=0.025)
    assert np.mean(hits < 0.8) >= 0.08  # the low-hit tail exists


def test_uniform_hits_stay_in_band():
    trace = generate(
        TraceConfig(
            sessions=40, turns=6, dist="uniform", seed=4, prompt_tokens=256, output_scale=10
        )
    )
    hits = np.array(
        [r.expected_hit for r in trace[1:]]
    )  # the very first request has nothing to hit
    assert trace[0].expected_hit == 0.0
    assert np.mean((hits >= 0.845) & (hits <= 0.955)) >= 0.95
    assert np.mean(hits > 0.95) < 0.02
    assert hits.mean() == pytest.approx(0.90, abs=0.02)


def test_expected_hit_is_the_real_prefix_reuse():
    trace = generate(
        TraceConfig(
            sessions=8,
            turns=5,
            seed=5,
            prompt_tokens=64,
            max_context_tokens=512,
            output_scale=20,
            vocab_low=100,
            vocab_high=140,
        )
    )
    ref = reference_hits(trace)
    assert [r.expected_hit for r in trace] == pytest.approx(ref, abs=1e-6)


def test_turns_extend_prompt_plus_output():
    trace = generate(TraceConfig(sessions=10, turns=5, seed=6, prompt_tokens=128, output_scale=10))
    by_session: dict[str, list[TraceRequest]] = {}
    for r in trace:
        by_session.setdefault(r.session_id, []).append(r)
    extended = 0
    for turns in by_session.values():
        assert [t.turn for t in turns] == list(range(5))
        assert [t.timestamp_ms for t in turns] == sorted(t.timestamp_ms for t in turns)
        for prev, nxt in zip(turns, turns[1:]):
            if len(nxt.output_slots) == 0:  # compaction restarts the context
                continue
            n = len(prev.prompt_token_ids)
            assert nxt.prompt_token_ids[:n] == prev.prompt_token_ids
            slot = nxt.output_slots[-1]
            assert (slot.start, slot.length, slot.request_id) == (
                n,
                prev.max_tokens,
                prev.request_id,
            )
            assert len(nxt.prompt_token_ids) > n + prev.max_tokens
            assert nxt.expected_hit == pytest.approx(
                (n + prev.max_tokens) / len(nxt.prompt_token_ids), abs=1e-6
            )
            extended += 1
    assert extended >= 35


def test_real_outputs_splice_into_their_slots():
    trace = generate(TraceConfig(sessions=2, turns=3, seed=7, prompt_tokens=32, output_scale=20))
    last = next(r for r in trace if r.turn == 2 and len(r.output_slots) == 2)
    s0, s1 = last.output_slots
    real = {
        s0.request_id: [7, 7],
        s1.request_id: [9] * (s1.length + 3),
    }  # shorter and longer than the slot
    got = last.prompt_with_outputs(real)
    p = last.prompt_token_ids
    between = p[s0.start + s0.length : s1.start]
    assert (
        got == p[: s0.start] + [7, 7] + between + [9] * (s1.length + 3) + p[s1.start + s1.length :]
    )
    assert last.prompt_with_outputs({}) == p


def test_output_lengths_are_report_shaped():
    rng = np.random.default_rng(0)
    for scale in (1, 10):
        n = np.array([sample_output_tokens(rng, scale) for _ in range(6000)])
        assert np.mean(n < 100 / scale) == pytest.approx(0.30, abs=0.03)
        assert np.mean(n <= 500 / scale) == pytest.approx(0.70, abs=0.03)
        assert n.min() >= 1 and n.max() <= 2048 / scale
    assert output_buckets(100)[0] == (
        0.3,
        1,
        1,
    )  # extreme scaling keeps disjoint, non-empty buckets


def test_hit_sampler_means():
    rng = np.random.default_rng(1)
    skew = np.array([sample_hit("skewed", rng) for _ in range(20000)])
    uni = np.array([sample_hit("uniform", rng) for _ in range(20000)])
    assert skew.mean() == pytest.approx(0.90, abs=0.005) and np.mean(skew > 0.95) == pytest.approx(
        0.75, abs=0.01
    )
    assert uni.mean() == pytest.approx(0.90, abs=0.005) and uni.min() >= 0.85 and uni.max() <= 0.95


def test_poisson_arrivals_rate_and_order():
    t = poisson_arrivals_ms(5000, 20.0, np.random.default_rng(2))
    assert t[0] == 0.0 and t == sorted(t)
    assert np.mean(np.diff(t)) == pytest.approx(50.0, rel=0.05)
    assert poisson_arrivals_ms(3, 0, np.random.default_rng(2)) == [0.0, 0.0, 0.0]


def test_seeded_and_reproducible(tmp_path):
    cfg = TraceConfig(sessions=6, turns=4, seed=11, prompt_tokens=64)
    a, b = generate(cfg), generate(cfg)
    assert a == b
    assert generate(TraceConfig(sessions=6, turns=4, seed=12, prompt_tokens=64)) != a
    assert all(cfg.vocab_low <= t < cfg.vocab_high for r in a for t in r.prompt_token_ids)
    write_trace(a, tmp_path / "t.jsonl")
    assert read_trace(tmp_path / "t.jsonl") == a


def test_cli_writes_the_trace(tmp_path, capsys):
    out = tmp_path / "trace.jsonl"
    assert (
        main(
            [
                "gen",
                "--sessions",
                "3",
                "--turns",
                "4",
                "--rps",
                "2",
                "--dist",
                "uniform",
                "--seed",
                "1",
                "--prompt-tokens",
                "100",
                "--output-scale",
                "10",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    trace = read_trace(out)
    assert len(trace) == 12 and len({r.session_id for r in trace}) == 3
    assert "12 requests" in capsys.readouterr().out


@pytest.mark.parametrize(
    "field,value",
    [
        ("sessions", 0),
        ("rps", -1.0),
        ("dist", "zipf"),
        ("output_scale", 0.5),
        ("max_context_tokens", 100),
        ("vocab_high", 50),
    ],
)
def test_config_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        TraceConfig(**{field: value})
