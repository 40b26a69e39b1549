"""An engine service's instance settings (``pdd.serving.engine_instance.InstanceConfig``):
tensor parallelism is vLLM's (its workers are processes of its own); our engine runs on one."""

from __future__ import annotations

import pytest

from pdd.core.instance import InstanceRef, Role
from pdd.engine.config import EngineConfig
from pdd.engine.protocol import EngineKind
from pdd.serving.engine_instance import InstanceConfig


def config(**kw) -> InstanceConfig:
    ref = InstanceRef("prefill-0", "127.0.0.1:0", Role.PREFILL)
    return InstanceConfig(ref, "127.0.0.1:7000", "tiny:1", EngineConfig(), **kw)


def test_tensor_parallel_is_for_the_vllm_engine_only():
    assert config(engine_kind=EngineKind.VLLM, tensor_parallel_size=2).tensor_parallel_size == 2
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: only the vLLM engine"):
        config(tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: must be >= 1"):
        config(engine_kind=EngineKind.VLLM, tensor_parallel_size=0)
