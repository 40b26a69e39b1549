"""Remote clusters in the testbed's stack: ``ClusterSpec``, ``StackConfig.clusters``, ``pdd up``.

What each cluster starts is checked on the command lines the stack would run (its launcher
replaced by a recorder): one ``wan-<cluster>`` per cluster with a route per MainDecode, every
MainDecode registering with its cluster and advertising its route. The stack itself runs in
tests/e2e/test_clusters.py.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from pdd import cli
from pdd.testbed import stack as stack_module
from pdd.testbed.launcher import Process
from pdd.testbed.stack import ClusterSpec, LinkSettings, Stack, StackConfig

TINY = "tiny:7,ctx=512"


def test_a_cluster_spec_parses_its_flag_form():
    spec = ClusterSpec.parse("slow:50:40:2")
    assert spec == ClusterSpec("slow", LinkSettings(50.0, 40.0), 2)
    assert spec.describe() == "50 Mbit/s, 40 ms one-way"
    assert ClusterSpec.parse("fast-1:0:0.5:1").describe() == "unlimited, 0.5 ms one-way"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("slow:50:40", "expected name:mbps:delay_ms:main_decodes"),
        ("slow:50:40:1:9", "expected name:mbps:delay_ms:main_decodes"),
        ("slow:fast:40:1", "mbps and delay_ms must be numbers"),
        ("slow:-5:40:1", "mbps: must be >= 0"),
        ("slow:50:nan:1", "delay_ms: must be >= 0"),
        ("slow:50:40:x", "main_decodes must be a whole number"),
        ("slow:50:40:0", "main_decodes: at least 1"),
        ("Slow:50:40:1", "name: a cluster is named by a DNS label"),
        ("-slow:50:40:1", "name: a cluster is named by a DNS label"),
        (":50:40:1", "name: a cluster is named by a DNS label"),
    ],
)
def test_a_malformed_cluster_is_refused_naming_what(text, message):
    with pytest.raises(ValueError, match=message):
        ClusterSpec.parse(text)


def test_stack_config_validates_its_clusters():
    fast, slow = ClusterSpec("fast"), ClusterSpec("slow", LinkSettings(10, 40), 2)
    cfg = StackConfig(model=TINY, clusters=(fast, slow))
    assert cfg.remote_clusters == (fast, slow)
    with pytest.raises(ValueError, match="^clusters: names must be unique, fast repeated"):
        StackConfig(model=TINY, clusters=(fast, slow, ClusterSpec("fast")))
    with pytest.raises(ValueError, match="^clusters: each cluster sets its own link"):
        StackConfig(model=TINY, clusters=(fast,), main_decode=2)
    with pytest.raises(ValueError, match="^clusters: each cluster sets its own link"):
        StackConfig(model=TINY, clusters=(fast,), wan=LinkSettings(mbps=5))


def test_without_clusters_the_stack_is_one_remote_cluster_of_wan_and_main_decode():
    cfg = StackConfig(model=TINY, main_decode=2, wan=LinkSettings(100, 5))
    assert cfg.remote_clusters == (ClusterSpec("remote", LinkSettings(100, 5), 2),)


class Recorder:
    """Stands in for ``start_module``: records each command line, "listens" on a made-up port."""

    def __init__(self) -> None:
        self.started: list[tuple[str, str, list[str]]] = []

    def __call__(self, name, module, args, **_):
        self.started.append((name, module, list(args)))
        proc = subprocess.Popen(["true"])
        proc.wait()
        address = f"127.0.0.1:{40000 + len(self.started)}"
        if module == "services.wan_link" and "--route" in args:
            address = args[args.index("--route") + 1].partition("=")[0]
        return Process(name, proc, address, module=module, args=tuple(args))

    def args_of(self, name: str) -> list[str]:
        return next(a for n, _, a in self.started if n == name)


def _flag(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


@pytest.fixture
def recorder(monkeypatch, tmp_path):
    rec = Recorder()
    monkeypatch.setattr(stack_module, "start_module", rec)
    return rec


def _started(recorder, tmp_path, **kwargs) -> Stack:
    cfg = StackConfig(
        model=TINY, redis_url="redis://127.0.0.1:1/0", log_dir=tmp_path, metrics=True, **kwargs
    )
    stack = Stack(cfg).start()
    return stack


def test_each_cluster_is_one_link_with_a_route_per_main_decode(recorder, tmp_path):
    clusters = (
        ClusterSpec("fast", LinkSettings(1000, 2), 2),
        ClusterSpec("slow", LinkSettings(20, 40)),
    )
    stack = _started(recorder, tmp_path, clusters=clusters)
    names = [n for n, _, _ in recorder.started]
    assert [n for n in names if n.startswith(("wan", "main_decode"))] == [
        "wan-fast",
        "main_decode-fast-0",
        "main_decode-fast-1",
        "wan-slow",
        "main_decode-slow-0",
    ]
    fast = recorder.args_of("wan-fast")
    routes = [r.split("=") for r in _flag(fast, "--route")]
    assert len(routes) == 2 and _flag(fast, "--mbps") == ["1000"]
    assert _flag(fast, "--delay-ms") == ["2"] and _flag(fast, "--metrics-port")
    assert _flag(recorder.args_of("wan-slow"), "--mbps") == ["20"]
    for i, (listen, upstream) in enumerate(routes):
        md = recorder.args_of(f"main_decode-fast-{i}")
        assert _flag(md, "--cluster") == ["fast"] and _flag(md, "--instance-id") == [
            f"main_decode-fast-{i}"
        ]
        # It is dialled through its route, which forwards to its own port.
        assert _flag(md, "--advertise-address") == [listen]
        assert upstream == f"127.0.0.1:{_flag(md, '--port')[-1]}"
    assert _flag(recorder.args_of("main_decode-slow-0"), "--cluster") == ["slow"]
    assert stack.cluster_of == {
        "main_decode-fast-0": "fast",
        "main_decode-fast-1": "fast",
        "main_decode-slow-0": "slow",
    }
    assert stack.link_of["main_decode-fast-1"] == "wan-fast" and "wan-fast" in stack.metrics
    assert cli.cluster_lines(stack) == [
        "cluster fast         link wan-fast (1000 Mbit/s, 2 ms one-way): "
        "main_decode-fast-0, main_decode-fast-1",
        "cluster slow         link wan-slow (20 Mbit/s, 40 ms one-way): main_decode-slow-0",
    ]


def test_the_default_shape_is_kept(recorder, tmp_path):
    stack = _started(recorder, tmp_path, main_decode=2, wan=LinkSettings(100, 5))
    names = [n for n, _, _ in recorder.started]
    assert [n for n in names if n.startswith(("wan", "main_decode"))] == [
        "wan-0",
        "main_decode-0",
        "wan-1",
        "main_decode-1",
    ]
    wan = recorder.args_of("wan-0")
    assert _flag(wan, "--listen") == ["127.0.0.1:0"] and not _flag(wan, "--route")
    assert not _flag(wan, "--metrics-port") and "wan-0" not in stack.metrics
    md = recorder.args_of("main_decode-1")
    assert _flag(md, "--cluster") == ["remote"] and _flag(md, "--instance-id") == ["main_decode-1"]
    assert cli.cluster_lines(stack) == [
        "cluster remote       link wan-0, wan-1 (100 Mbit/s, 5 ms one-way, one each): "
        "main_decode-0, main_decode-1"
    ]


def _up_error(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("slow:50", "argument --cluster: expected name:mbps:delay_ms:main_decodes"),
        ("slow:50:40:0", "argument --cluster: main_decodes: at least 1"),
        ("SLOW:50:40:1", "argument --cluster: name: a cluster is named by a DNS label"),
    ],
)
def test_pdd_up_refuses_a_malformed_cluster_in_one_line(value, expected, capsys, tmp_path):
    code, last = _up_error(["up", "--log-dir", str(tmp_path / "up"), "--cluster", value], capsys)
    assert code == 2 and last.startswith("pdd up: error: ") and expected in last, last
    assert not (tmp_path / "up").exists()


def test_pdd_up_refuses_repeated_names_and_a_bad_cluster_file(capsys, tmp_path):
    logs = str(tmp_path / "up")
    argv = [
        "up",
        "--model",
        TINY,
        "--log-dir",
        logs,
        "--cluster",
        "a:1:1:1",
        "--cluster",
        "a:2:2:1",
    ]
    code, last = _up_error(argv, capsys)
    assert code == 1 and "clusters: names must be unique, a repeated" in last, last
    bad = tmp_path / "clusters.json"
    bad.write_text(json.dumps([{"name": "x", "main_decodes": 0}]))
    code, last = _up_error(
        ["up", "--model", TINY, "--log-dir", logs, "--cluster-file", str(bad)], capsys
    )
    assert code == 1 and f"--cluster-file {bad}: main_decodes: at least 1" in last, last
    assert not (tmp_path / "up").exists()


def test_a_cluster_file_is_the_same_as_the_flags(tmp_path):
    path = tmp_path / "clusters.json"
    path.write_text(
        json.dumps(
            [
                {"name": "fast", "mbps": 1000, "delay_ms": 2, "main_decodes": 2},
                {"name": "slow", "mbps": 20, "delay_ms": 40, "jitter_ms": 3},
            ]
        )
    )
    assert cli._clusters_of_file(path) == (
        ClusterSpec("fast", LinkSettings(1000, 2), 2),
        ClusterSpec("slow", LinkSettings(20, 40, 3), 1),
    )
