"""The soak's verdict (pure): each check fails on what it exists to catch."""

from __future__ import annotations

from pdd.bench.soak_samples import Sample, parse_metrics, verdict


def _s(t, name, rss, fds=10, pid=1, **gauges):
    return Sample(t, name, pid, rss, fds, gauges)


def test_verdict_catches_growth_leaks_and_errors():
    """The verdict's checks fail on what they exist to catch (and pass on a flat run)."""
    flat = [_s(-1, "relay-0", 100, pdd_asyncio_tasks=5)]
    flat += [_s(t, "relay-0", 100, pdd_asyncio_tasks=9) for t in range(0, 60, 5)]
    flat += [_s(61, "relay-0", 100, pdd_asyncio_tasks=5)]
    assert all(c.ok for c in verdict(flat, {"completed": 9, "cancelled": 1}, warmup_s=10))

    grown = [_s(t, "relay-0", 100 + t, pdd_asyncio_tasks=5) for t in range(-1, 60, 5)]
    by = {c.name: c for c in verdict(grown, {"completed": 9, "UNAVAILABLE": 2}, warmup_s=10)}
    assert not by["rss_flat"].ok and "relay-0" in by["rss_flat"].detail
    assert not by["errors"].ok and "UNAVAILABLE 2" in by["errors"].detail

    leaky = [_s(t, "gw", 100, fds=10 + t, pdd_asyncio_tasks=5 + t) for t in range(-1, 60, 5)]
    leaky.append(_s(62, "gw", 100, fds=80, requests_held=1, pdd_asyncio_tasks=80))
    by = {c.name: c for c in verdict(leaky, {"completed": 1}, warmup_s=10)}
    assert not by["fds_flat"].ok and not by["tasks_flat"].ok and not by["nothing_held"].ok

    held = verdict(flat, {"completed": 1}, warmup_s=10, held_at_end={"main_decode-0": 2})
    assert "main_decode-0 holds 2" in next(c for c in held if c.name == "nothing_held").detail


def test_a_restarted_process_is_judged_from_its_own_warm_up():
    """The relay restarted at 30 s (new pid, small RSS while it loads) is judged from when it
    listened again plus the warm-up, on its new pid only."""
    ss = [_s(t, "relay-0", 100, pid=1) for t in range(0, 30, 2)]
    ss += [_s(t, "relay-0", 10 + 3 * (t - 30), pid=2) for t in range(30, 40, 2)]  # loading
    ss += [_s(t, "relay-0", 100, pid=2) for t in range(40, 80, 2)]
    by = {c.name: c for c in verdict(ss, {}, warmup_s=10, since={"relay-0": 38})}
    assert by["rss_flat"].ok, by["rss_flat"].detail
    by = {c.name: c for c in verdict(ss, {}, warmup_s=0, since={"relay-0": 30})}
    assert not by["rss_flat"].ok


def test_parse_metrics_sums_the_watched_gauges_over_labels():
    text = """# HELP pdd_kv_blocks_used x
pdd_kv_blocks_used{role="relay",instance_id="relay-0"} 12.0
pdd_kv_blocks_used{role="relay",instance_id="relay-1"} 3.0
pdd_asyncio_tasks 7.0
pdd_engine_requests{role="relay",instance_id="relay-0",state="running"} 1.0
pdd_engine_requests{role="relay",instance_id="relay-0",state="paused"} 2.0
pdd_kv_blocks_total{role="relay",instance_id="relay-0"} 99.0
garbage line
"""
    assert parse_metrics(text) == {
        "pdd_kv_blocks_used": 15.0,
        "pdd_asyncio_tasks": 7.0,
        "requests_held": 3.0,
    }


def test_descriptor_growth_names_the_kinds_that_grew():
    """A descriptor leak is reported with what it is made of (sockets, shm mappings, ...)."""
    ss = [
        Sample(t, "prefill-0", 1, 100, 20 + t // 10, {}, {"socket": 10 + t // 10, "file": 10})
        for t in range(0, 120, 10)
    ]
    by = {c.name: c for c in verdict(ss, {}, warmup_s=0)}
    assert not by["fds_flat"].ok and "(socket +11)" in by["fds_flat"].detail, by["fds_flat"].detail


def test_fd_kinds_from_proc_links():
    import os

    from pdd.bench.soak_samples import fd_kind, read_process

    assert [
        fd_kind(t)
        for t in (
            "socket:[123]", "pipe:[9]", "anon_inode:[eventfd]", "anon_inode:[eventpoll]",
            "/dev/shm/pdd-x", "/memfd:pdd (deleted)", "/tmp/log.txt",
        )
    ] == ["socket", "pipe", "eventfd", "eventpoll", "shm", "shm", "file"]  # fmt: skip
    r, w = os.pipe()
    try:
        rss, n, kinds = read_process(os.getpid())
        assert rss > 0 and n >= sum(kinds.values()) and kinds.get("pipe", 0) >= 2
    finally:
        os.close(r)
        os.close(w)
    assert read_process(2**22 + 7) == (0, 0, {})


def test_the_idle_end_is_judged_by_its_least_sample():
    """After the drain, a periodic task (a link probe) shows in one idle sample: not growth; a
    leaked task or request shows in every one: growth."""
    base = [_s(-1, "prefill-0", 100, pdd_asyncio_tasks=13)]
    base += [_s(t, "prefill-0", 100, pdd_asyncio_tasks=20) for t in range(0, 60, 5)]
    probe = base + [
        _s(61 + i, "prefill-0", 100, pdd_asyncio_tasks=n) for i, n in enumerate([13, 13, 16])
    ]
    by = {c.name: c for c in verdict(probe, {}, warmup_s=10, idle_from_s=61)}
    assert by["tasks_flat"].ok, by["tasks_flat"].detail
    # the last sample alone (the old judgement) took the probe for a leak
    assert not {c.name: c for c in verdict(probe, {}, warmup_s=10)}["tasks_flat"].ok
    leak = base + [
        _s(61 + i, "prefill-0", 100, pdd_asyncio_tasks=16, requests_held=1) for i in range(3)
    ]
    by = {c.name: c for c in verdict(leak, {}, warmup_s=10, idle_from_s=61)}
    assert not by["tasks_flat"].ok and "13 -> 16" in by["tasks_flat"].detail
    assert not by["nothing_held"].ok
