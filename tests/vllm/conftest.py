"""Fixtures of the vLLM tests, run by ``make test`` in the vLLM venv (``.venv-vllm``).

One tiny random Llama, saved as a Hugging Face directory, loaded by our engine and by three
in-process vLLM engines (one per role: ``md`` decodes, ``prefill`` computes and exports,
``relay`` decodes first and hands over); each vLLM engine starts once per session (30-60 s on 2 cores; vLLM's compile cache makes the second
start ~10 s). Prompts span several of vLLM's 128-token CPU blocks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# NOTE: before vLLM is imported: thread placement for its CPU build, a small KV pool.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

MODEL = "tiny:5,vocab=512,hidden=128,inter=256,layers=2,heads=4,kv_heads=2,ctx=2048"


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from pdd.serving.engine_instance import hf_model_dir

    return hf_model_dir(MODEL)


@pytest.fixture(scope="session")
def md_events() -> list:
    return []


@pytest.fixture(scope="session")
def md(model_dir, md_events):
    """The vLLM engine in MainDecode's place (its cache events collected in ``md_events``)."""
    from pdd.engine.config import EngineConfig
    from pdd.engine_vllm.engine import VllmEngine

    eng = VllmEngine(model_dir, EngineConfig(max_num_seqs=16), md_events.append)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def prefill(model_dir, md):  # NOTE: after md: one vLLM start at a time
    from pdd.engine.config import EngineConfig
    from pdd.engine_vllm.engine import VllmEngine

    eng = VllmEngine(model_dir, EngineConfig(max_num_seqs=16))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def relay(model_dir, prefill):  # NOTE: after prefill: one vLLM start at a time
    """The vLLM engine in the relay's place (started only by the relay tests)."""
    from pdd.engine.config import EngineConfig
    from pdd.engine_vllm.engine import VllmEngine

    eng = VllmEngine(model_dir, EngineConfig(max_num_seqs=16))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def ours(model_dir):
    """Our engine on the same weights."""
    from pdd.engine.checkpoint import load_checkpoint
    from pdd.engine.config import EngineConfig
    from pdd.engine.engine import Engine

    return Engine(load_checkpoint(str(model_dir)), EngineConfig(block_size=16, num_blocks=512))
