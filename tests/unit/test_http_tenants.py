"""Tenants of the OpenAI API: ``--api-keys key:tenant`` maps each key to a tenant whose cache salt
every request of that key carries, combined with (never replaced by) the salt the client sent,
so no client can name another tenant's salt. What the stages then do with salts (no shared KV
blocks, no shared hit predictions) is tests/e2e/test_tenants.py."""

from __future__ import annotations

import json

import pytest

from pdd.core.pipeline import Pipeline
from pdd.core.request import FinalEvent, RequestStats
from pdd.http.config import HttpConfig
from pdd.http.openai_convert import tenant_salt
from tests.unit import test_http_api
from tests.unit.test_http_api import ScriptedGateway, post

serve = test_http_api.serve  # the fixture: the HTTP face on a loopback port

KEYS = ("sk-a:acme", "sk-a2:acme", "sk-b:beta", "sk-plain")


@pytest.mark.parametrize(
    "keys, message",
    [
        (("k:",), "key:tenant"),
        ((":t",), "key:tenant"),
        (("k:a:b",), "tenant without"),
        (("k:a", "k:b"), "once"),
        (("k", "k"), "once"),
    ],
)
def test_bad_key_tenant_entries_are_refused(keys, message):
    with pytest.raises(ValueError, match=message):
        HttpConfig(api_keys=keys)


def test_keys_and_tenants_are_derived_from_api_keys():
    cfg = HttpConfig(api_keys=KEYS)
    assert cfg.keys == ("sk-a", "sk-a2", "sk-b", "sk-plain")
    assert cfg.tenants == {"sk-a": "acme", "sk-a2": "acme", "sk-b": "beta", "sk-plain": ""}
    assert HttpConfig(api_keys=("k1", "k2")).tenants == {}  # no tenants: salts pass unchanged


def test_tenant_salts_are_distinct_and_bounded():
    salts = {
        tenant_salt(t, s)
        for t, s in [("acme", ""), ("beta", ""), ("acme", "x"), ("", "acme"), ("a", "bc")]
    }
    salts.add(tenant_salt("ab", "c"))
    assert len(salts) == 6
    assert all(len(s) <= 128 and s.isascii() and " " not in s for s in salts)
    assert tenant_salt("acme", "x") == tenant_salt("acme", "x")  # a tenant's repeats share


async def _salt_of(url, key, **body):
    gw_status, _, text = await post(
        f"{url}/v1/completions",
        {"model": "m", "prompt": "hi", **body},
        {"Authorization": f"Bearer {key}"},
    )
    assert gw_status == 200, text


async def test_each_key_carries_its_tenants_salt_combined_with_the_clients(serve):
    gw = ScriptedGateway()
    url = await serve(gw, api_keys=KEYS)
    await _salt_of(url, "sk-a")
    await _salt_of(url, "sk-a2")
    await _salt_of(url, "sk-b")
    await _salt_of(url, "sk-a", cache_salt="s1")
    await _salt_of(url, "sk-b", cache_salt="s1")
    # beta sends acme's combined salt as its own: it stays inside beta
    await _salt_of(url, "sk-b", cache_salt=tenant_salt("acme", ""))
    await _salt_of(url, "sk-plain", cache_salt="acme")
    salts = [j.cache_salt for j in gw.jobs]
    assert salts[0] == salts[1] == tenant_salt("acme", "")  # one tenant, two keys: one cache
    assert salts[2] == tenant_salt("beta", "")
    assert salts[3] == tenant_salt("acme", "s1") != salts[4] == tenant_salt("beta", "s1")
    assert salts[5] == tenant_salt("beta", tenant_salt("acme", "")) != salts[0]
    assert salts[6] == tenant_salt("", "acme")
    assert len(set(salts)) == 6


async def test_without_tenants_the_clients_salt_passes_unchanged(serve):
    gw = ScriptedGateway()
    url = await serve(gw, api_keys=("k1",))
    await _salt_of(url, "k1", cache_salt="mine")
    url = await serve(gw)
    await _salt_of(url, "ignored", cache_salt="mine")
    assert [j.cache_salt for j in gw.jobs] == ["mine", "mine"]


class StatsGateway(ScriptedGateway):
    """Ends each request with the given stats (its pipeline and cached-token counts)."""

    def __init__(self, stats: RequestStats) -> None:
        super().__init__()
        self.stats = stats

    async def generate(self, job, ending=None, deadline_s=None):
        async for ev in super().generate(job, ending):
            if isinstance(ev, FinalEvent):
                ev = FinalEvent(ev.finish_reason, self.stats)
            yield ev


@pytest.mark.parametrize(
    "pipeline, cached", [(Pipeline.P_MD, 8), (Pipeline.P_RLD_MD, 8), (Pipeline.MD, 24)]
)
@pytest.mark.parametrize("stream", [False, True])
async def test_usage_reports_the_cached_prompt_tokens(serve, pipeline, cached, stream):
    stats = RequestStats(
        pipeline=pipeline,
        prompt_tokens=30,
        completion_tokens=2,
        prefill_cached_tokens=8,
        md_cached_tokens=24,
    )
    url = await serve(StatsGateway(stats))
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    status, _, text = await post(f"{url}/v1/completions", body)
    assert status == 200
    if stream:
        text = [b for b in text.split("\n\n") if b.startswith("data: {")][-1][len("data: ") :]
    usage = json.loads(text)["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": cached}
