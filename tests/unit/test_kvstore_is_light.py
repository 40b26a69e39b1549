"""kvstore holds an index, not a model: it must start without loading torch."""

import subprocess
import sys

import pytest


def test_kvstore_service_does_not_import_torch():
    code = "import sys, services.kvstore.server; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False", out.stderr


def test_engine_package_exports_resolve_lazily():
    import pdd.engine as engine

    assert engine.SamplingParams(max_tokens=2).max_tokens == 2
    assert engine.Engine.__name__ == "Engine"
    assert set(engine.__all__) >= {"Engine", "EngineConfig", "SamplingParams", "tiny_model"}
    with pytest.raises(AttributeError, match="NoSuchThing"):
        engine.NoSuchThing  # noqa: B018
