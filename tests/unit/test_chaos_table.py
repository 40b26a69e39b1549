"""The chaos table's measurement: recorded streams in, lost/duplicated/identical out."""

from __future__ import annotations

import pytest

from pdd.bench.chaos_measure import StreamRecord, check_stream, fault_row, markdown_table


def test_a_gapless_stream_is_clean():
    c = check_stream([(0, [5]), (1, [6, 7]), (3, [8])], expected=4)
    assert (c.tokens, c.lost, c.duplicated, c.conflicting) == ((5, 6, 7, 8), 0, 0, 0)


def test_a_repeated_position_counts_as_duplicated_and_a_changed_one_as_conflicting():
    c = check_stream([(0, [5, 6]), (1, [6, 9]), (2, [7])], expected=3)
    assert c.tokens == (5, 6, 9)
    assert c.duplicated == 2  # positions 1 and 2 came twice
    assert c.conflicting == 1  # position 2: 9, then 7


def test_a_gap_is_lost_and_the_output_stops_before_it():
    c = check_stream([(0, [5]), (2, [7])], expected=4)
    assert c.lost == 2  # position 1 never came, nor 3 of a completed 4-token stream
    assert c.tokens == (5,)


def test_a_failed_streams_missing_tail_is_not_lost():
    c = check_stream([(0, [5, 6])], expected=None)
    assert (c.tokens, c.lost) == ((5, 6), 0)


def test_a_negative_start_is_refused():
    with pytest.raises(ValueError, match="chunks"):
        check_stream([(-1, [5])], expected=1)


def _rec(index, chunks, status="OK", seeded=False, max_tokens=3, start=0.0, end=10.0, mig=0):
    r = StreamRecord(index, f"r{index}", seeded, max_tokens, chunks=chunks, start_s=start)
    r.end_s, r.status, r.migrations = end, status, mig
    return r


def test_fault_row_counts_completed_failed_identical_and_in_flight():
    ref = {0: [1, 2, 3], 1: [4, 5, 6], 2: [7, 8, 9], 3: [1, 1, 1]}
    records = [
        _rec(0, [(0, [1]), (1, [2, 3])], mig=1),  # identical, migrated
        _rec(1, [(0, [4, 5, 6])], seeded=True),  # identical
        _rec(2, [(0, [7, 8])], status="DEADLINE_EXCEEDED", start=6.0),  # failed, a true prefix
        _rec(3, [(0, [1, 2, 1])], seeded=True, end=4.0),  # completed, changed
    ]
    row = fault_row("main_decode", records, ref, pipeline="p-md", injected_at_s=5.0)
    assert (row.requests, row.completed, row.failed) == (4, 3, 1)
    assert row.statuses == {"DEADLINE_EXCEEDED": 1}
    assert (row.identical_greedy, row.greedy) == (1, 2)
    assert (row.identical_seeded, row.seeded) == (1, 2)
    assert row.changed == 1 and row.migrated == 1
    assert row.in_flight == 2  # 0 and 1 ran across t=5; 2 started after, 3 ended before
    assert row.lost == row.duplicated == 0
    assert not row.clean
    assert "DEADLINE_EXCEEDED 1" in markdown_table([row])


def test_a_row_is_clean_only_when_injected_and_nothing_went_wrong():
    ref = {0: [1, 2, 3]}
    ok = [_rec(0, [(0, [1, 2, 3])])]
    assert fault_row("relay", ok, ref, injected_at_s=1.0).clean
    assert not fault_row("relay", ok, ref).clean  # never injected: it proves nothing
    assert not fault_row("relay", ok, ref, injected_at_s=1.0, requests_holding_kv=1).clean
    dup = [_rec(0, [(0, [1, 2]), (1, [2, 3])])]
    row = fault_row("relay", dup, ref, injected_at_s=1.0)
    assert row.duplicated == 1 and row.identical_greedy == 1 and not row.clean
