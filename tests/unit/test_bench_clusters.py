"""``pdd bench clusters``: its preset, the stacks it starts, what it scrapes and its table."""

from __future__ import annotations

import math

import pytest

from pdd.bench import clusters, modes
from pdd.bench.clusters import ClustersBenchConfig, Row
from pdd.testbed.stack import ClusterSpec, LinkSettings


def _flag(args, flag: str) -> list[str]:
    args = list(args)
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_the_preset_is_a_fast_and_a_slow_cluster():
    fast, slow = clusters.PRESETS["two-cluster"]
    assert (fast.name, slow.name) == ("fast", "slow")
    assert fast.link.mbps > modes.Testbed().wan_mbps > slow.link.mbps > 0
    assert clusters.slowest((fast, slow)) == "slow"
    assert clusters.slowest((ClusterSpec("a"), ClusterSpec("b", LinkSettings(5, 1)))) == "b"


@pytest.mark.parametrize(
    ("contender", "relays", "policy"),
    [("cdc-pd", 0, "threshold"), ("hit-only", 1, "threshold"), ("link-aware", 1, "link_aware")],
)
def test_each_contender_is_its_mode_on_the_clusters_with_its_policy(
    contender, relays, policy, tmp_path
):
    preset = clusters.PRESETS["two-cluster"]
    cfg = clusters.stack_config(
        contender,
        modes.Testbed(),
        preset,
        log_dir=tmp_path,
        gateway_flags=("--ttft-budget-s", "0.4"),
    )
    assert cfg.clusters == preset and cfg.relay == relays and cfg.wan == LinkSettings()
    assert _flag(cfg.gateway_flags, "--pipeline-policy") == [policy]
    assert _flag(cfg.gateway_flags, "--ttft-budget-s") == ["0.4"]
    # The rest of the mode's stack is the mode's own (engine sizes, θ, the router's seed).
    mode = modes.stack_config(clusters.CONTENDERS[contender][0], modes.Testbed(), log_dir=tmp_path)
    assert cfg.engine_flags == mode.engine_flags and cfg.env == mode.env
    assert cfg.gateway_flags[: len(mode.gateway_flags)] == mode.gateway_flags
    record = modes.clusters_record(cfg, modes.Testbed())
    assert [c["name"] for c in record["clusters"]] == ["fast", "slow"]
    assert record["relays"] == relays


def _hist(buckets: dict[float, float], total: float):
    out = [("pdd_wan_kv_queue_seconds_bucket", {"le": str(le)}, v) for le, v in buckets.items()]
    count = max(buckets.values())
    return out + [
        ("pdd_wan_kv_queue_seconds_count", {}, count),
        ("pdd_wan_kv_queue_seconds_sum", {}, total),
    ]


def test_queue_time_is_the_histograms_mean_and_p90_bucket():
    samples = _hist({0.001: 5, 0.01: 8, 0.1: 9, 1.0: 10, math.inf: 10}, total=1.5)
    assert clusters.queue_ms(samples) == {"mean": 150.0, "p90": 100.0, "pushes": 10}
    assert clusters.queue_ms([]) == {"mean": None, "p90": None, "pushes": 0}


def test_link_bytes_count_what_went_towards_the_cluster():
    samples = [
        ("pdd_wan_link_bytes_total", {"route": "a", "direction": "up"}, 100.0),
        ("pdd_wan_link_bytes_total", {"route": "b", "direction": "up"}, 50.0),
        ("pdd_wan_link_bytes_total", {"route": "a", "direction": "down"}, 7.0),
        ("pdd_wan_link_connections", {"route": "a"}, 1.0),
    ]
    assert clusters.link_bytes(samples) == 150.0


def _result(p90: float, p99: float, rld: float | None, errors: int = 0) -> dict:
    return {
        "ttfdt_ms": {"p50": 1.0, "p90": p90, "p99": p99},
        "rld_token_share": rld,
        "pipelines": {"p-md": 3, "p-rld-md": 1},
        "errors": errors,
    }


def test_the_table_puts_the_routers_side_by_side_with_ratios_to_cdc_pd():
    measured = {
        "wan_queue_ms": {"mean": 12.0, "p90": 50.0},
        "link_bytes": {"fast": 300.0, "slow": 100.0},
        "slowest": "slow",
    }
    rows = [
        clusters.row_of("uniform", "cdc-pd", _result(1000, 2000, None), measured),
        clusters.row_of("uniform", "hit-only", _result(800, 1500, 0.6), measured),
        clusters.row_of("uniform", "link-aware", _result(500, 900, 0.05), {}),
    ]
    assert rows[1] == Row(
        "uniform", "hit-only", 800, 1500, 0.6, 12.0, 50.0, 0.25, rows[1].pipelines, 0
    )
    cells = clusters.table_cells(rows)
    assert cells[0][:5] == ["dist", "router", "TTFDT P90 ms", "TTFDT P99 ms", "P90 ÷ cdc-pd"]
    assert [c[4] for c in cells[1:]] == ["1.00", "0.80", "0.50"]
    assert cells[2][5] == "60.0%" and cells[3][5] == "5.0%" and cells[2][8] == "25.0%"
    assert cells[3][6] == "-" and cells[2][9] == "p-md:3 p-rld-md:1"
    text = clusters.text_table(rows).splitlines()
    assert len(text) == 5 and text[1].startswith("---")
    md = clusters.markdown_table(rows).splitlines()
    assert md[0].startswith("| dist | router |") and len(md) == 5


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"preset": "three"}, "preset"),
        ({"dists": ()}, "dists"),
        ({"dists": ("zipf",)}, "dists"),
        ({"contenders": ("threshold",)}, "contenders"),
        ({"contenders": ("cdc-pd", "cdc-pd")}, "contenders"),
        ({"clusters": (ClusterSpec("a"), ClusterSpec("a"))}, "clusters"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        ClustersBenchConfig(**kwargs)


def test_a_bad_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        clusters.main(["--contenders", "nope"])
    assert exc.value.code == 2 and "contenders: each one of" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        clusters.main(["--cluster", "x:1"])
    assert exc.value.code == 2 and "argument --cluster: expected" in capsys.readouterr().err
