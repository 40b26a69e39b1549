"""An engine service's instance settings (``pdd.serving.engine_instance.InstanceConfig``):
tensor parallelism is vLLM's (its workers are processes of its own); our engine runs on one;
prefill and MainDecode gather a burst before an idle first step, the relay does not."""

from __future__ import annotations

import argparse

import pytest

from pdd.core.instance import InstanceRef, Role
from pdd.engine.config import EngineConfig
from pdd.engine.protocol import EngineKind
from pdd.serving.engine_instance import InstanceConfig
from services.instance_flags import (
    BURST_GAP_MS,
    BURST_WAIT_MS,
    add_instance_flags,
)


def config(**kw) -> InstanceConfig:
    ref = InstanceRef("prefill-0", "127.0.0.1:0", Role.PREFILL)
    return InstanceConfig(ref, "127.0.0.1:7000", "tiny:1", EngineConfig(), **kw)


def test_tensor_parallel_is_for_the_vllm_engine_only():
    assert config(engine_kind=EngineKind.VLLM, tensor_parallel_size=2).tensor_parallel_size == 2
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: only the vLLM engine"):
        config(tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: must be >= 1"):
        config(engine_kind=EngineKind.VLLM, tensor_parallel_size=0)


def test_burst_gathering_settings_are_validated_and_prefill_and_main_decode_gather():
    with pytest.raises(ValueError, match=r"^burst_wait_ms: must be >= 0"):
        config(burst_wait_ms=-1)
    with pytest.raises(ValueError, match=r"^burst_gap_ms: must be > 0"):
        config(burst_wait_ms=10, burst_gap_ms=0)
    defaults = {}
    for role in (Role.PREFILL, Role.RELAY, Role.MAIN_DECODE):
        parser = argparse.ArgumentParser()
        add_instance_flags(parser, role)
        args = parser.parse_args([])
        defaults[role] = (args.burst_wait_ms, args.burst_gap_ms)
    assert defaults == {
        Role.PREFILL: (BURST_WAIT_MS, BURST_GAP_MS),
        Role.RELAY: (0, 2.0),
        Role.MAIN_DECODE: (BURST_WAIT_MS, BURST_GAP_MS),
    }


def test_the_core_turns_lock_file_needs_an_existing_directory(tmp_path):
    assert config(core_turns=str(tmp_path / "cores.lock")).core_turns.endswith("cores.lock")
    assert config().core_turns == ""  # no turns
    with pytest.raises(ValueError, match=r"^core_turns: the lock file's directory"):
        config(core_turns=str(tmp_path / "missing" / "cores.lock"))
