"""``pdd bench --engine vllm``: the flag reaches every engine service of each mode's stack, and a
Python that cannot import vLLM is refused before any stack starts (no engine starts here)."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from pdd.bench import modes, runner


def _testbed(*flags: str) -> modes.Testbed:
    p = argparse.ArgumentParser()
    runner.add_testbed_flags(p)
    return runner.testbed_from(p.parse_args(list(flags)))


def test_engine_flag_reaches_every_engine_service_of_each_mode(tmp_path):
    testbed = _testbed("--engine", "vllm")
    assert testbed.engine == "vllm"
    for mode in modes.MODES:
        flags = modes.stack_config(mode, testbed, log_dir=tmp_path).engine_flags
        assert flags[flags.index("--engine") + 1] == "vllm"
        assert modes.link_record(mode, testbed)["engine"] == "vllm"
    ours = modes.stack_config("pdd", _testbed(), log_dir=tmp_path).engine_flags
    assert ours[ours.index("--engine") + 1] == "pdd"
    assert "engine" not in modes.link_record("pdd", _testbed())  # our records keep their shape


def test_an_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="engine: must be one of"):
        modes.Testbed(engine="sglang")


def test_vllm_not_importable_is_a_clear_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    with pytest.raises(ValueError, match=r"engine: vllm is not importable by .*pdd\[vllm\]"):
        _testbed("--engine", "vllm")
    assert _testbed().engine == "pdd"  # our engine needs no vLLM
