"""Each engine role asks its admission at its admit step, before any work: MainDecode, prefill
and the relay on a tiny engine refuse a request beyond their bounds with RESOURCE_EXHAUSTED at
once, leave nothing of it in the engine, and keep serving the ones they admitted."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdd.core.errors import ResourceExhaustedError
from pdd.core.instance import InstanceRef, Role
from pdd.core.pipeline import HandoffMode, Pipeline
from pdd.core.stage_events import Accepted, DecodeJob, Finished, PrefillJob, RelayJob, Tokens
from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine
from pdd.engine.sampling import SamplingParams
from pdd.kv.receiver import KvReceiver
from pdd.server.errors import status_for
from pdd.server.tls import TlsConfig
from pdd.serving.admission import AdmissionConfig
from pdd.serving.channels import Channels
from pdd.serving.engine_loop import EngineLoop
from pdd.serving.main_decode import MainDecode
from pdd.serving.model_spec import load_model
from pdd.serving.prefill import Prefill, PrefillPeers
from pdd.serving.relay import Relay

MODEL = "tiny:3,ctx=256,layers=2,hidden=64,inter=128"
PROMPT = tuple(1 + (i * 7) % 250 for i in range(12))
MD_REF = InstanceRef("m0", "127.0.0.1:7003", Role.MAIN_DECODE, "remote")
RELAY_REF = InstanceRef("r0", "127.0.0.1:7002", Role.RELAY)


@pytest.fixture(scope="module")
def ckpt():
    return load_model(MODEL)


class _Instance:
    """What the roles read of an ``EngineInstance``: its engine and the loop stepping it."""

    def __init__(self, engine: Engine, runner: EngineLoop) -> None:
        self.engine, self.runner = engine, runner


@pytest.fixture
async def instance(ckpt):
    engine = Engine(ckpt, EngineConfig(block_size=4, num_blocks=64))
    loop = EngineLoop(engine)
    await loop.start()
    yield _Instance(engine, loop)
    await loop.stop()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def md_job(rid: str, n: int = 6) -> DecodeJob:
    return DecodeJob(rid, PROMPT, greedy(n), "", Pipeline.MD)


def refusal(exc: BaseException) -> None:
    assert isinstance(exc, ResourceExhaustedError)
    assert status_for(exc)[0] is grpc.StatusCode.RESOURCE_EXHAUSTED


async def holds(inst: _Instance, rid: str) -> bool:
    return await inst.runner.call(inst.engine.holds_request, rid)


async def test_main_decode_refuses_beyond_its_bound_and_finishes_the_admitted_one(instance):
    md = MainDecode(instance, KvReceiver(), admission=AdmissionConfig(max_admitted=1))
    first = md.decode(md_job("a"))
    assert isinstance(await anext(first), Accepted)
    assert md.admission.reserved_tokens == len(PROMPT) + 6
    with pytest.raises(ResourceExhaustedError) as err:
        await anext(md.decode(md_job("b")))
    refusal(err.value)
    assert not await holds(instance, "b")
    # the admitted request runs to its end, untouched by the refusal
    events = [ev async for ev in first]
    assert sum(len(ev.token_ids) for ev in events if isinstance(ev, Tokens)) == 6
    assert isinstance(events[-1], Finished)
    assert (md.admission.admitted, md.admission.reserved_tokens) == (0, 0)
    second = md.decode(md_job("b"))
    assert isinstance(await anext(second), Accepted)
    await second.aclose()  # a cancelled request gives its place back too
    assert md.admission.admitted == 0


async def test_main_decode_refuses_beyond_its_token_bound(instance):
    md = MainDecode(instance, KvReceiver(), admission=AdmissionConfig(max_admitted_tokens=30))
    first = md.decode(md_job("a", n=10))  # 12 + 10 reserved
    assert isinstance(await anext(first), Accepted)
    with pytest.raises(ResourceExhaustedError, match=r"22 \+ 22 KV tokens reserved \(max 30\)"):
        await anext(md.decode(md_job("b", n=10)))
    await first.aclose()


async def test_prefill_refuses_before_computing_or_pushing_anything(instance):
    def never(*_):
        raise AssertionError("a refused request must not reach a peer")

    prefill = Prefill(
        instance, peers=PrefillPeers(never, never), admission=AdmissionConfig(max_admitted=1)
    )
    held = prefill.admission.admit("other", 1)
    job = PrefillJob("p", PROMPT, greedy(1), "", Pipeline.P_RLD_MD, MD_REF, 0, RELAY_REF)
    with pytest.raises(ResourceExhaustedError) as err:
        await anext(prefill.prefill(job))
    refusal(err.value)
    assert not await holds(instance, "p")
    assert "p" not in prefill._active  # NOTE: the same request may be sent again later
    held.release()
    assert prefill.admission.admitted == 0


async def test_the_relay_refuses_before_adding_the_request(instance):
    relay = Relay(
        instance,
        fast=None,  # NOTE: a refused request never reaches the fast link
        channels=Channels(TlsConfig()),
        main_decode=lambda ref: None,
        admission=AdmissionConfig(max_admitted_tokens=10),
    )
    held = relay.admission.admit("other", 5)
    job = RelayJob("r", PROMPT, greedy(4), "", MD_REF, HandoffMode.ONE_SHOT)
    with pytest.raises(ResourceExhaustedError, match=r"5 \+ 16 KV tokens"):
        await anext(relay.decode(job))
    assert not await holds(instance, "r") and "r" not in relay._active
    held.release()
    await asyncio.sleep(0)
    assert relay.admission.admitted == 0
