"""A service's HTTP listeners (the gateway's OpenAI API, every service's /metrics) under TLS.

With a certificate they speak HTTPS only, with the service's identity, and with client auth they
demand a client certificate signed by the CA — like the gRPC port. Real servers on loopback ports,
certificates from ``make certs``' generator.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request

import aiohttp
import pytest

from pdd.http.config import HttpConfig
from pdd.http.openai_api import OpenAIServer
from pdd.server.tls import TlsConfig
from pdd.telemetry.metrics import start_metrics_server
from pdd.tools import certs
from tests.unit.test_http_api import INFO, ScriptedGateway, decode


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    certs.generate(out)
    return out


def server_tls(folder, *, mutual: bool) -> TlsConfig:
    return TlsConfig(
        cert=str(folder / "gateway.crt"),
        key=str(folder / "gateway.key"),
        ca=str(folder / "ca.crt"),
        require_client_cert=mutual,
    )


def client_context(folder, *, with_cert: bool) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(folder / "ca.crt"))
    if with_cert:
        ctx.load_cert_chain(str(folder / "client.crt"), str(folder / "client.key"))
    return ctx


def test_plaintext_without_a_certificate_and_a_clear_error_for_unreadable_files(tmp_path):
    assert TlsConfig().server_ssl_context() is None
    assert (
        TlsConfig(ca="/etc/ssl/certs/ca-certificates.crt").server_ssl_context() is None
    )  # a client-only config
    missing = TlsConfig(cert=str(tmp_path / "no.crt"), key=str(tmp_path / "no.key"))
    with pytest.raises(ValueError, match="no.crt"):
        missing.server_ssl_context()


async def _completion(url: str, ctx: ssl.SSLContext | bool) -> int:
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{url}/v1/completions",
            ssl=ctx,
            data=json.dumps({"model": "m", "prompt": "hi", "max_tokens": 3}),
        ) as r:
            await r.read()
            return r.status


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
async def test_openai_api_is_https_only_with_a_certificate(folder, mutual):
    server = OpenAIServer(
        ScriptedGateway(), INFO, decode, HttpConfig(port=0, tls=server_tls(folder, mutual=mutual))
    )
    await server.start()
    try:
        assert (
            await _completion(
                f"https://127.0.0.1:{server.port}", client_context(folder, with_cert=True)
            )
            == 200
        )
        with pytest.raises(aiohttp.ClientError):  # a plaintext client gets no HTTP answer
            await _completion(f"http://127.0.0.1:{server.port}", False)
        if mutual:
            with pytest.raises(aiohttp.ClientError):  # no client certificate: the handshake fails
                await _completion(
                    f"https://127.0.0.1:{server.port}", client_context(folder, with_cert=False)
                )
        else:
            assert (
                await _completion(
                    f"https://127.0.0.1:{server.port}", client_context(folder, with_cert=False)
                )
                == 200
            )
    finally:
        await server.stop()


def _scrape(url: str, ctx: ssl.SSLContext | None = None) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10, context=ctx) as r:
        return r.read().decode()


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_metrics_are_https_only_with_a_certificate(folder, mutual):
    server, port = start_metrics_server("127.0.0.1", 0, server_tls(folder, mutual=mutual))
    try:
        assert "pdd_" in _scrape(
            f"https://127.0.0.1:{port}", client_context(folder, with_cert=True)
        )
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            _scrape(f"http://127.0.0.1:{port}")
        if mutual:
            with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
                _scrape(f"https://127.0.0.1:{port}", client_context(folder, with_cert=False))
        else:
            assert "pdd_" in _scrape(
                f"https://127.0.0.1:{port}", client_context(folder, with_cert=False)
            )
    finally:
        server.shutdown()


def test_metrics_stay_plaintext_without_a_certificate():
    server, port = start_metrics_server("127.0.0.1", 0, TlsConfig())
    try:
        assert "pdd_" in _scrape(f"http://127.0.0.1:{port}")
    finally:
        server.shutdown()
