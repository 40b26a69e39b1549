"""The layering of docs/architecture.md, checked on every module's imports (lazy ones too).

core ← engine / kv / routing / prefix_index / telemetry ← server ← wire ← serving ←
http / testbed / tools ← bench ← cli, services. Generated code is touched only where the wire is
(converters, typed clients, servicers) and by the command-line clients.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LAYERS = {
    "pdd.core": 0,
    "pdd.engine": 1,
    "pdd.kv": 1,
    "pdd.routing": 1,
    "pdd.prefix_index": 1,
    "pdd.telemetry": 1,
    "pdd.server": 2,
    # The engine boundary over vLLM: above our engine (its records), beside server.
    "pdd.engine_vllm": 2,
    "pdd.wire": 3,
    "pdd.serving": 4,
    "pdd.http": 5,
    "pdd.testbed": 5,
    "pdd.tools": 5,
    "pdd.client": 5,
    "pdd.bench": 6,
    "pdd.cli": 7,
    "services": 7,
}
# Who may import generated protobuf: the wire itself, kv's own transfer messages and the gRPC
# transports built on them, the servicers, the tools that are gRPC clients of the gateway, and
# the OpenAI face, which states a request in the gateway's public contract (GenerateRequest) so
# that one validator (pdd.wire.gateway.generate_from_pb) judges both doors alike.
GEN_ALLOWED = (
    "pdd.wire.",
    "pdd.http.openai_convert",
    "pdd.kv.messages",
    "pdd.kv.push_codec",
    "pdd.kv.wan",
    "pdd.kv.fast_link.tcp",
    "pdd.server.",
    "pdd.bench.",
    "pdd.testbed.",
    "pdd.client",
    "pdd.cli",
    "pdd.tools.",
    "services.",
)
THIRD_PARTY_FORBIDDEN = {
    "pdd.core": {"torch", "grpc", "redis", "numpy", "structlog", "aiohttp"},
    "pdd.routing": {"torch", "grpc", "redis"},
    "pdd.serving": {"grpc"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for base in ("pdd", "services"):
        for path in (ROOT / base).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            if rel.parts[:2] == ("pdd", "gen"):
                continue
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            out[name] = path
    return out


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def _layer(module: str) -> tuple[str, int] | None:
    for prefix, layer in sorted(LAYERS.items(), key=lambda kv: -len(kv[0])):
        if module == prefix or module.startswith(prefix + "."):
            return prefix, layer
    return None


MODULES = _modules()


def test_the_tree_is_read():
    assert "pdd.serving.gateway" in MODULES and "pdd.core.request" in MODULES


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_a_layer_above_its_own(module):
    own = _layer(module)
    if own is None:
        return
    bad = []
    for name in _imports(MODULES[module]):
        target = _layer(name)
        if target is None or target[0] == own[0]:
            continue
        # NOTE: same-layer packages stay apart too (engine does not reach into kv, ...).
        if target[1] >= own[1]:
            bad.append(name)
    assert not bad, f"{module} (layer {own[1]}) imports upward or sideways: {sorted(set(bad))}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_generated_code_stays_at_the_edge(module):
    if module.startswith(GEN_ALLOWED) or module in ("pdd.cli", "pdd.client"):
        return
    gen = [n for n in _imports(MODULES[module]) if n.startswith("pdd.gen")]
    assert not gen, f"{module} imports generated code: {sorted(set(gen))}"


@pytest.mark.parametrize("package", sorted(THIRD_PARTY_FORBIDDEN))
def test_light_packages_stay_light(package):
    forbidden = THIRD_PARTY_FORBIDDEN[package]
    for module, path in MODULES.items():
        if module == package or module.startswith(package + "."):
            heavy = {n.split(".")[0] for n in _imports(path)} & forbidden
            assert not heavy, f"{module} imports {sorted(heavy)}"
