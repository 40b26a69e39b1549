"""The whole stack under mutual TLS: every inter-service channel speaks it, or no token flows.

Every process gets the same ``PDD_TLS_*`` environment (``Stack`` starts them all alike), so
they share one identity from ``make certs``' CA; every server demands a client certificate.
A request through P-RLD-MD uses each channel: gateway → kvstore/prefill/relay/main_decode,
prefill → relay (fast link over gRPC) and → main_decode across the WAN emulator, relay →
main_decode (handoff), every instance → kvstore (membership). The Node.js client streams over
mutual TLS too, and every service's /metrics is HTTPS only, demanding a client certificate.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import replace

import grpc
import pytest

from pdd.bench.loadgen import LoadConfig, run_load
from pdd.bench.trace import TraceRequest
from pdd.client import generate_stream
from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine
from pdd.engine.sampling import SamplingParams
from pdd.gen.common.v1 import common_pb2
from pdd.server.tls import TlsConfig
from pdd.serving.model_spec import load_model
from pdd.tools import certs
from tests.e2e.conftest import BLOCK, TINY, make_stack
from tests.e2e.test_clients import MAX_TOKENS, PROMPT, node_test


@pytest.fixture(scope="module")
def tls_stack(redis_url, tmp_path_factory):
    folder = tmp_path_factory.mktemp("certs")
    certs.generate(folder)
    env = {
        "PDD_TLS_CERT": str(folder / "relay.crt"),
        "PDD_TLS_KEY": str(folder / "relay.key"),
        "PDD_TLS_CA": str(folder / "ca.crt"),
        "PDD_TLS_CLIENT_AUTH": "true",
    }
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        stack = make_stack(redis_url, tmp_path_factory.mktemp("tls-stack"))
    yield stack, folder
    codes = stack.stop()
    assert all(code == 0 for code in codes.values()), f"unclean exits: {codes}"


@pytest.fixture(scope="module")
def reference(llama_oracle):
    ckpt = load_model(TINY)
    return Engine(ckpt, EngineConfig(block_size=BLOCK)), llama_oracle(ckpt)


async def _generate(address, prompt, tls, max_tokens=12, **fields):
    tokens, final = [], None
    async for resp in generate_stream(
        address, prompt, max_tokens=max_tokens, timeout=120, ignore_eos=True, tls=tls, **fields
    ):
        tokens.extend(resp.token_ids)
        if resp.HasField("stats"):
            final = resp.stats
    return tokens, final


@pytest.mark.parametrize(
    "pipeline", [common_pb2.PIPELINE_P_RLD_MD, common_pb2.PIPELINE_P_MD], ids=["p-rld-md", "p-md"]
)
async def test_pipeline_runs_over_mutual_tls(tls_stack, reference, pipeline):
    stack, folder = tls_stack
    client = TlsConfig(
        cert=str(folder / "client.crt"), key=str(folder / "client.key"), ca=str(folder / "ca.crt")
    )
    prompt = [5, 17, 33, 2, 99, 41, 8, 120, 64, 3, 77]
    tokens, stats = await _generate(
        stack.gateway.address,
        prompt,
        client,
        force_pipeline=pipeline,
        handoff_mode=common_pb2.HANDOFF_MODE_ONE_SHOT,
        cache_salt=f"tls-{pipeline}",
    )
    assert stats is not None and stats.pipeline == pipeline
    if pipeline == common_pb2.PIPELINE_P_RLD_MD:
        assert stats.rld_tokens + stats.md_tokens == 11
    engine, oracle = reference
    oracle.assert_greedy_equal(
        prompt, tokens, engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    )


async def test_gateway_refuses_plaintext_and_clients_without_a_certificate(tls_stack):
    stack, folder = tls_stack
    for tls in (TlsConfig(), TlsConfig(ca=str(folder / "ca.crt"))):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _generate(stack.gateway.address, [1, 2, 3], tls)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_node_client_streams_over_mutual_tls(tls_stack):
    stack, folder = tls_stack
    client = TlsConfig(
        cert=str(folder / "client.crt"), key=str(folder / "client.key"), ca=str(folder / "ca.crt")
    )
    expected, _ = await _generate(stack.gateway.address, PROMPT, client, max_tokens=MAX_TOKENS)
    env = {"PDD_TLS_CA": client.ca, "PDD_TLS_CERT": client.cert, "PDD_TLS_KEY": client.key}
    # NOTE: in a thread: npm's run is blocking and this test's event loop must stay free.
    await asyncio.to_thread(node_test, stack.gateway.address, expected, env)


def _cli_generate(address: str, *flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDD_TLS_")}
    return subprocess.run(
        [sys.executable, "-m", "pdd.cli", "generate", "hello", "--gateway", address, *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


async def test_pdd_generate_speaks_mutual_tls_with_flags(tls_stack):
    stack, folder = tls_stack
    flags = (
        "--tls-ca",
        str(folder / "ca.crt"),
        "--tls-cert",
        str(folder / "client.crt"),
        "--tls-key",
        str(folder / "client.key"),
    )
    # NOTE: the tiny test model has no tokenizer, so the gateway itself answers a text prompt with
    # INVALID_ARGUMENT: that answer proves the request crossed the mutual-TLS channel.
    out = await asyncio.to_thread(_cli_generate, stack.gateway.address, *flags)
    assert out.returncode == 1 and "INVALID_ARGUMENT: prompt:" in out.stderr, out.stderr
    plain = await asyncio.to_thread(_cli_generate, stack.gateway.address)
    assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr, plain.stderr
    half = await asyncio.to_thread(
        _cli_generate, stack.gateway.address, "--tls-cert", str(folder / "client.crt")
    )
    assert half.returncode == 2 and "--tls-cert and --tls-key go together" in half.stderr, (
        half.stderr
    )


async def test_load_generator_replays_over_mutual_tls(tls_stack):
    stack, folder = tls_stack
    client = TlsConfig(
        cert=str(folder / "client.crt"), key=str(folder / "client.key"), ca=str(folder / "ca.crt")
    )
    req = TraceRequest(
        request_id="tls-load",
        session_id="s",
        timestamp_ms=0.0,
        prompt_token_ids=[5, 17, 33, 2, 99, 41, 8],
        max_tokens=6,
        expected_hit=0.0,
    )
    ok = (
        await run_load(
            [req],
            LoadConfig(
                target=stack.gateway.address, tls=client, progress=False, cache_salt="tls-load"
            ),
        )
    ).records[0]
    assert ok.ok and len(ok.output_token_ids) == 6, ok.error_message
    refused = (
        await run_load(
            [replace(req, request_id="tls-load-plain")],
            LoadConfig(target=stack.gateway.address, progress=False),
        )
    ).records[0]
    assert refused.error_code == "UNAVAILABLE"


def test_every_services_metrics_are_served_over_mutual_tls(tls_stack):
    stack, folder = tls_stack
    ctx = ssl.create_default_context(cafile=str(folder / "ca.crt"))
    ctx.load_cert_chain(str(folder / "client.crt"), str(folder / "client.key"))
    assert stack.metrics, "the stack serves /metrics"
    for name, address in stack.metrics.items():
        with urllib.request.urlopen(f"https://{address}/metrics", timeout=10, context=ctx) as r:
            assert b"pdd_" in r.read(), name
        with pytest.raises(
            (urllib.error.URLError, ConnectionError)
        ):  # no plaintext scrape under TLS
            urllib.request.urlopen(f"http://{address}/metrics", timeout=10)
