"""kvstore's registry and index under hostile values: RegisterInstance, DeregisterInstance,
Heartbeat and PublishCacheEvents over a real gRPC port and a real Redis.

A table names each rule's field (ids, addresses, roles, cluster names, block size, lease, model,
reported links); then hypothesis sends batches of hostile calls — phantom instances with any
values, and calls naming the real instances that carry at least one invalid value — and checks,
call by call, the status a written-out spec of the rules predicts (``_fault``). After every
batch the real instances are listed exactly as registered, PredictHits answers them exactly as
before, every phantom kvstore accepted satisfies the spec, and the answers still fit a default
client's 4 MiB message limit. The cases run are counted and printed, with a floor.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import string

import grpc
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pdd.core.block_hash import chain_hashes
from pdd.gen.common.v1 import common_pb2
from pdd.gen.kvstore.v1 import kvstore_service_pb2 as pb
from pdd.gen.kvstore.v1 import kvstore_service_pb2_grpc as pb_grpc
from pdd.server.bootstrap import GrpcServer
from pdd.server.config import ServerConfig
from services.kvstore.config import KvstoreConfig
from services.kvstore.server import build

EXAMPLES = 80
IA, OK, NF = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND
ROLES = (common_pb2.ROLE_PREFILL, common_pb2.ROLE_RELAY, common_pb2.ROLE_MAIN_DECODE)
# The real instances: id → (role, address, cluster, block size).
REAL = {
    "p-0": (common_pb2.ROLE_PREFILL, "127.0.0.1:7001", "main", 4),
    "relay-0": (common_pb2.ROLE_RELAY, "127.0.0.1:7002", "main", 4),
    "md-0": (common_pb2.ROLE_MAIN_DECODE, "[::1]:7003", "remote", 8),
}
PROMPTS = [list(range(100, 140)), list(range(7, 40)), list(range(100, 116))]
SALT = "tenant-a"

# --- the spec, written out (not the converter's code): the first field a request breaks ---------

_ID_CHARS = frozenset(string.ascii_letters + string.digits + "._:@-")
_CLUSTER_CHARS = frozenset(string.ascii_letters + string.digits + "._-")
_HOST_CHARS = frozenset(string.ascii_letters + string.digits + "._-")
_IPV6_CHARS = frozenset(string.hexdigits + ":.")


def _id_ok(s: str) -> bool:
    return 1 <= len(s) <= 128 and set(s) <= _ID_CHARS


def _cluster_ok(s: str) -> bool:
    return 1 <= len(s) <= 64 and set(s) <= _CLUSTER_CHARS


def _address_ok(a: str) -> bool:
    host, sep, port = a.rpartition(":")
    if not sep or not 1 <= len(port) <= 5 or not set(port) <= set(string.digits):
        return False
    if not 0 < int(port) < 65536:
        return False
    if host.startswith("[") and host.endswith("]"):
        return 2 <= len(host) - 2 <= 45 and set(host[1:-1]) <= _IPV6_CHARS
    return 1 <= len(host) <= 253 and set(host) <= _HOST_CHARS


def _register_fault(msg: pb.RegisterInstanceRequest) -> str | None:
    ref = msg.ref
    if not _id_ok(ref.instance_id):
        return "ref.instance_id"
    if not _address_ok(ref.address):
        return "ref.address"
    if ref.role not in ROLES:
        return "ref.role"
    if ref.cluster and not _cluster_ok(ref.cluster):
        return "ref.cluster"
    if not 1 <= msg.block_size <= 4096:
        return "block_size"
    if not 1 <= msg.ttl_ms <= 24 * 3600 * 1000:
        return "ttl_ms"
    if len(msg.model) > 1024 or not msg.model.isprintable():
        return "model"
    return None


def _load_fault(load: pb.InstanceLoad) -> str | None:
    if len(load.links) > 64:
        return "load.links"
    for i, lk in enumerate(load.links):
        if not _cluster_ok(lk.cluster):
            return f"load.links[{i}].cluster"
        if not (math.isfinite(lk.throughput_bps) and lk.throughput_bps >= 0):
            return f"load.links[{i}].throughput_bps"
        if not (math.isfinite(lk.rtt_s) and lk.rtt_s >= 0):
            return f"load.links[{i}].rtt_s"
    clusters = [lk.cluster for lk in load.links]
    for i, c in enumerate(clusters):
        if c in clusters[:i]:
            return f"load.links[{i}].cluster"
    return None


def _events_fault(events) -> str | None:
    for i, ev in enumerate(events):
        if ev.kind not in (1, 2, 3):
            return f"events[{i}].kind"
        if ev.kind != 3 and not ev.block_hashes:
            return f"events[{i}].block_hashes"
    return None


def _fault(rpc: str, msg) -> str | None:
    """The field the spec says ``msg`` breaks first; None when it is a valid request."""
    if rpc == "RegisterInstance":
        return _register_fault(msg)
    if not _id_ok(msg.instance_id):
        return "instance_id"
    if rpc == "Heartbeat":
        return _load_fault(msg.load)
    if rpc == "PublishCacheEvents":
        return _events_fault(msg.events)
    return None


# --- a kvstore on a real port, over a real Redis ------------------------------------------------


class Kvstore:
    async def start(self, redis_url: str, key_prefix: str) -> Kvstore:
        config = KvstoreConfig(
            server=ServerConfig(port=0, grace_s=0.5), redis_url=redis_url, key_prefix=key_prefix
        )
        self.server = GrpcServer(config.server, build(config))
        port = await self.server.start()
        # NOTE: a client with grpc's default limits (4 MiB answers), as a plain client has.
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.KvstoreServiceStub(self.channel)
        return self

    async def stop(self) -> None:
        await self.channel.close()
        await self.server.stop()

    async def call(self, rpc: str, msg) -> tuple[grpc.StatusCode, str]:
        try:
            await getattr(self.stub, rpc)(msg, timeout=30)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        return OK, ""


def _ref(instance_id: str) -> common_pb2.InstanceRef:
    role, address, cluster, _ = REAL[instance_id]
    return common_pb2.InstanceRef(
        instance_id=instance_id, address=address, role=role, cluster=cluster
    )


def _real_load(instance_id: str) -> pb.InstanceLoad:
    links = [pb.LinkState(cluster="remote", throughput_bps=1e8, rtt_s=0.02, healthy=True)]
    return pb.InstanceLoad(
        running_requests=3,
        kv_blocks_used=5,
        kv_blocks_total=64,
        links=links * (instance_id == "p-0"),
    )


async def _seed(kv: Kvstore) -> None:
    """Register the real instances, report their load and publish what they cache."""
    for iid, (_, _, _, block) in REAL.items():
        req = pb.RegisterInstanceRequest(
            ref=_ref(iid), block_size=block, model="tiny", ttl_ms=600_000, reset_index=True
        )
        assert await kv.call("RegisterInstance", req) == (OK, "")
        assert await kv.call(
            "Heartbeat", pb.HeartbeatRequest(instance_id=iid, load=_real_load(iid))
        ) == (OK, "")
    held = {"p-0": (PROMPTS[0], 5), "md-0": (PROMPTS[0], 3), "relay-0": (PROMPTS[1], 2)}
    for iid, (prompt, blocks) in held.items():
        hashes = chain_hashes(prompt, REAL[iid][3], SALT)[:blocks]
        event = pb.CacheEvent(kind=pb.CACHE_EVENT_KIND_STORED, block_hashes=hashes, cache_salt=SALT)
        req = pb.PublishCacheEventsRequest(instance_id=iid, events=[event], first_seq=1)
        assert await kv.call("PublishCacheEvents", req) == (OK, "")


async def _view(kv: Kvstore) -> tuple[dict, dict]:
    """The real instances as listed (all but the heartbeat time) and as PredictHits answers them;
    and every other listed instance, keyed by id."""
    listed = await kv.stub.ListInstances(pb.ListInstancesRequest(), timeout=30)
    real, phantoms = {}, {}
    for info in listed.instances:
        info.last_heartbeat_ms = 0
        (real if info.ref.instance_id in REAL else phantoms)[info.ref.instance_id] = info
    hits = {}
    for i, prompt in enumerate(PROMPTS):
        for salt in ("", SALT):
            for only in ((), tuple(REAL)):
                req = pb.PredictHitsRequest(
                    prompt_token_ids=prompt, cache_salt=salt, instance_ids=only
                )
                resp = await kv.stub.PredictHits(req, timeout=30)
                got = {h.instance.ref.instance_id: h.cached_tokens for h in resp.hits}
                hits[i, salt, only] = {k: v for k, v in got.items() if k in REAL}
    return {"real": real, "hits": hits}, phantoms


# --- 1. each rule names its field ----------------------------------------------------------------


def _register(**kw) -> pb.RegisterInstanceRequest:
    ref = dict(instance_id="x-1", address="10.0.0.1:5000", role=common_pb2.ROLE_PREFILL)
    ref |= kw.pop("ref", {})
    base = dict(ref=common_pb2.InstanceRef(**ref), block_size=16, ttl_ms=6000, model="m")
    return pb.RegisterInstanceRequest(**(base | kw))


def _link(**kw) -> pb.LinkState:
    return pb.LinkState(**({"cluster": "remote", "throughput_bps": 1.0} | kw))


TABLE = [
    ("RegisterInstance", _register(ref={"instance_id": "a b"}), "ref.instance_id"),
    ("RegisterInstance", _register(ref={"instance_id": "md-{0}"}), "ref.instance_id"),
    ("RegisterInstance", _register(ref={"instance_id": "x" * 129}), "ref.instance_id"),
    ("RegisterInstance", _register(ref={"instance_id": "caf\u00e9"}), "ref.instance_id"),
    ("RegisterInstance", _register(ref={"address": "h:0"}), "ref.address"),
    ("RegisterInstance", _register(ref={"address": "a b:80"}), "ref.address"),
    ("RegisterInstance", _register(ref={"address": "h:\u0668\u0660"}), "ref.address"),
    ("RegisterInstance", _register(ref={"address": "h" * 254 + ":80"}), "ref.address"),
    ("RegisterInstance", _register(ref={"address": "\x00:1"}), "ref.address"),
    ("RegisterInstance", _register(ref={"role": 0}), "ref.role"),
    ("RegisterInstance", _register(ref={"role": 9}), "ref.role"),
    ("RegisterInstance", _register(ref={"cluster": "a b"}), "ref.cluster"),
    ("RegisterInstance", _register(ref={"cluster": "c" * 65}), "ref.cluster"),
    ("RegisterInstance", _register(block_size=0), "block_size"),
    ("RegisterInstance", _register(block_size=2**32 - 1), "block_size"),
    ("RegisterInstance", _register(ttl_ms=2**32 - 1), "ttl_ms"),
    ("RegisterInstance", _register(model="m" * 3_000_000), "model"),
    ("RegisterInstance", _register(model="a\nb"), "model"),
    ("Heartbeat", pb.HeartbeatRequest(instance_id="a b"), "instance_id"),
    (
        "Heartbeat",
        pb.HeartbeatRequest(instance_id="x", load=pb.InstanceLoad(links=[_link()] * 65)),
        "load.links",
    ),
    (
        "Heartbeat",
        pb.HeartbeatRequest(instance_id="x", load=pb.InstanceLoad(links=[_link(), _link()])),
        "load.links[1].cluster",
    ),
    (
        "Heartbeat",
        pb.HeartbeatRequest(
            instance_id="x", load=pb.InstanceLoad(links=[_link(throughput_bps=math.nan)])
        ),
        "load.links[0].throughput_bps",
    ),
    (
        "Heartbeat",
        pb.HeartbeatRequest(instance_id="x", load=pb.InstanceLoad(links=[_link(cluster="{x}")])),
        "load.links[0].cluster",
    ),
    ("DeregisterInstance", pb.DeregisterInstanceRequest(instance_id="}"), "instance_id"),
    ("DeregisterInstance", pb.DeregisterInstanceRequest(), "instance_id"),
    (
        "PublishCacheEvents",
        pb.PublishCacheEventsRequest(
            instance_id="x\ny", events=[pb.CacheEvent(kind=pb.CACHE_EVENT_KIND_CLEARED)]
        ),
        "instance_id",
    ),
]


@pytest.mark.parametrize(
    ("rpc", "request_", "field"), TABLE, ids=[f"{rpc}-{field}" for rpc, _, field in TABLE]
)
async def test_each_hostile_value_is_invalid_argument_naming_its_field(
    redis_url, key_prefix, rpc, request_, field
):
    assert _fault(rpc, request_) == field  # the written-out spec agrees with the table
    kv = await Kvstore().start(redis_url, key_prefix)
    try:
        code, details = await kv.call(rpc, request_)
        assert (code, details.partition(":")[0]) == (IA, field), details
        listed = await kv.stub.ListInstances(pb.ListInstancesRequest())
        assert list(listed.instances) == []  # nothing was registered
    finally:
        await kv.stop()


# --- 2. batches of hostile calls leave the real instances' answers as they were -----------------

GOOD_ID = st.text(alphabet=sorted(_ID_CHARS), min_size=1, max_size=128).filter(
    lambda s: s not in REAL
)
BAD_ID = st.one_of(
    st.sampled_from(["", "a b", "md-{0}", "}", "{", "x\x00", "caf\u00e9", "a\nb", "x" * 129]),
    st.integers(129, 1_000_000).map(lambda n: "i" * n),
    st.text(max_size=12).filter(lambda s: not _id_ok(s)),
)
TEXT = st.characters(whitelist_categories=("L", "M", "N", "P", "S"))  # printable, no spaces
GOOD_CLUSTER = st.text(alphabet=sorted(_CLUSTER_CHARS), min_size=1, max_size=64)
BAD_CLUSTER = st.one_of(
    st.sampled_from(["a b", "{x}", "c" * 65, "\u00e9", "x\ny"]),
    st.integers(65, 500_000).map(lambda n: "c" * n),
)
GOOD_ADDRESS = st.builds(
    lambda h, p: f"{h}:{p}",
    st.one_of(st.text(alphabet=sorted(_HOST_CHARS), min_size=1, max_size=30), st.just("[::1]")),
    st.integers(1, 65535),
)
BAD_ADDRESS = st.one_of(
    st.sampled_from(
        ["", "nohost", ":80", "h:0", "h:65536", "h:-1", "h: 80", "a b:80", "h:80x", "\x00:1"]
    ),
    st.sampled_from(["h:\u0668\u0660", "[fe80::1%eth0]:5", "[]:80", "[zz]:80", "h" * 254 + ":1"]),
    st.text(max_size=20).filter(lambda a: not _address_ok(a)),
)
# Each field of a registration: (valid values, invalid ones).
REGISTRATION = {
    "address": (GOOD_ADDRESS, BAD_ADDRESS),
    "role": (st.sampled_from(ROLES), st.sampled_from([0, -1, 4, 9, 2**31 - 1])),
    "cluster": (st.one_of(st.just(""), GOOD_CLUSTER), BAD_CLUSTER),
    "block_size": (st.integers(1, 4096), st.sampled_from([0, 4097, 2**16, 2**31, 2**32 - 1])),
    "ttl_ms": (
        st.sampled_from([1, 300, 6000, 24 * 3600 * 1000]),
        st.sampled_from([0, 24 * 3600 * 1000 + 1, 2**32 - 1]),
    ),
    "model": (
        st.text(alphabet=TEXT, max_size=40),
        st.one_of(
            st.sampled_from(["a\x00b", "m\n", "\u200b", "tab\there"]),
            st.integers(1025, 3_000_000).map(lambda n: "m" * n),
        ),
    ),
}
FLOAT = st.one_of(
    st.floats(0, 1e12), st.sampled_from([math.nan, math.inf, -math.inf, -1.0, -0.0, 1e308])
)
U64 = st.integers(0, 2**64 - 1)


def _link_pb(c, tp, q, f, rtt, at, h) -> pb.LinkState:
    return pb.LinkState(
        cluster=c,
        throughput_bps=tp,
        queued_bytes=q,
        in_flight_bytes=f,
        rtt_s=rtt,
        measured_at_ms=at,
        healthy=h,
    )


ANY_LINK = st.builds(
    _link_pb,
    st.one_of(st.just(""), GOOD_CLUSTER, BAD_CLUSTER),
    FLOAT,
    U64,
    U64,
    FLOAT,
    U64,
    st.booleans(),
)
GOOD_LINK = st.builds(
    _link_pb, GOOD_CLUSTER, st.floats(0, 1e12), U64, U64, st.floats(0, 10), U64, st.booleans()
)
U32 = st.one_of(st.integers(0, 10), st.sampled_from([4096, 2**16, 2**31, 2**32 - 1]))


def _load(links) -> st.SearchStrategy[pb.InstanceLoad]:
    return st.builds(
        lambda n, links: pb.InstanceLoad(
            running_requests=n[0],
            waiting_requests=n[1],
            kv_blocks_used=n[2],
            kv_blocks_total=n[3],
            links=links,
        ),
        st.tuples(U32, U32, U32, U32),
        links,
    )


LOAD = st.one_of(
    _load(st.lists(GOOD_LINK, max_size=3, unique_by=lambda lk: lk.cluster)),
    _load(st.lists(ANY_LINK, max_size=3)),
    _load(st.integers(65, 200).map(lambda n: [pb.LinkState(cluster=f"c{i}") for i in range(n)])),
)


# The real instances' own block hashes: a phantom claiming (or evicting) them must not move
# the real instances' hits.
REAL_HASHES = sorted(
    {h for prompt in PROMPTS for bs in (4, 8) for h in chain_hashes(prompt, bs, SALT)}
    | {h for prompt in PROMPTS for bs in (4, 8) for h in chain_hashes(prompt, bs)}
)
HASH = st.one_of(U64, st.sampled_from(REAL_HASHES))


def _event(kinds, min_hashes: int) -> st.SearchStrategy[pb.CacheEvent]:
    return st.builds(
        lambda kind, hashes, parent, salt: pb.CacheEvent(
            kind=kind, block_hashes=hashes, parent_hash=parent, cache_salt=salt
        ),
        kinds,
        st.lists(HASH, min_size=min_hashes, max_size=6),
        st.one_of(st.just(0), HASH),
        st.text(max_size=8),
    )


EVENTS = st.one_of(
    st.lists(_event(st.integers(1, 3), 1), max_size=4),
    st.lists(_event(st.integers(0, 5), 0), max_size=4),
)
RPCS = ["RegisterInstance", "Heartbeat", "DeregisterInstance", "PublishCacheEvents"]


def _registration(draw, iid: str, at_real: bool) -> pb.RegisterInstanceRequest:
    """A registration with no invalid field, one, or any number ("chaos"); at a real instance,
    always at least one."""
    modes = [*REGISTRATION, "chaos"] if at_real else ["valid", "valid", "chaos", *REGISTRATION]
    broken = draw(st.sampled_from(modes))
    v = {
        name: draw(st.one_of(good, bad) if broken == "chaos" else bad if broken == name else good)
        for name, (good, bad) in REGISTRATION.items()
    }
    ref = common_pb2.InstanceRef(
        instance_id=iid, address=v["address"], role=v["role"], cluster=v["cluster"]
    )
    msg = pb.RegisterInstanceRequest(
        ref=ref,
        block_size=v["block_size"],
        model=v["model"],
        ttl_ms=v["ttl_ms"],
        reset_index=draw(st.booleans()),
    )
    if at_real and _fault("RegisterInstance", msg) is None:  # chaos drew only valid values
        msg.block_size = 0
    return msg


def _hostile(draw, pool: list[str]):
    """One hostile call: (rpc, message, aimed at a real instance)."""
    rpc = draw(st.sampled_from(RPCS))
    at_real = rpc != "DeregisterInstance" and draw(st.integers(0, 3)) == 0
    if at_real:
        iid = draw(st.sampled_from(sorted(REAL)))
    else:
        iid = draw(st.one_of(st.sampled_from(pool), st.sampled_from(pool), GOOD_ID, BAD_ID))
    if rpc == "RegisterInstance":
        msg = _registration(draw, iid, at_real)
    elif rpc == "Heartbeat":
        msg = pb.HeartbeatRequest(instance_id=iid, load=draw(LOAD))
        if at_real and _fault(rpc, msg) is None:  # a real one's load must not change
            msg.load.links.append(pb.LinkState(cluster="remote", rtt_s=math.nan))
    elif rpc == "DeregisterInstance":
        msg = pb.DeregisterInstanceRequest(instance_id=iid)
    else:
        msg = pb.PublishCacheEventsRequest(
            instance_id=iid, events=draw(EVENTS), first_seq=draw(st.sampled_from([0, 1, 2**64 - 1]))
        )
        if at_real and _fault(rpc, msg) is None:  # nor its index
            msg.events.append(pb.CacheEvent(kind=draw(st.integers(4, 2**20))))
    return rpc, msg, at_real


def test_hostile_calls_leave_the_real_instances_and_their_predictions_as_they_were(
    redis_url, key_prefix
):
    loop = asyncio.new_event_loop()
    kv = loop.run_until_complete(Kvstore().start(redis_url, key_prefix))
    loop.run_until_complete(_seed(kv))
    before, none = loop.run_until_complete(_view(kv))
    assert none == {}
    # The seeded answers, checked once so that "unchanged" means "right".
    assert before["hits"][0, SALT, ()] == {"p-0": 20, "md-0": 24, "relay-0": 0}
    assert before["hits"][1, SALT, ()] == {"p-0": 0, "md-0": 0, "relay-0": 8}
    assert all(v == 0 for v in before["hits"][0, "", ()].values())
    counts: dict[str, int] = {}
    examples = itertools.count()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        phases=[Phase.generate],  # NOTE: the examples share one kvstore: no replay, no shrink
    )
    @given(data=st.data())
    def batch(data):
        pool = data.draw(st.lists(GOOD_ID, min_size=1, max_size=3))
        # A phantom that got in (a valid registration of a made-up instance, which kvstore cannot
        # tell from a real one): the batch's hostile events and heartbeats may then land.
        phantom = REAL["md-0"][:3]
        req = pb.RegisterInstanceRequest(
            ref=common_pb2.InstanceRef(
                instance_id=pool[0], address="10.9.9.9:1", role=phantom[0], cluster=phantom[2]
            ),
            block_size=data.draw(st.sampled_from([4, 8, 16])),
            ttl_ms=600_000,
        )
        assert loop.run_until_complete(kv.call("RegisterInstance", req)) == (OK, "")
        for _ in range(data.draw(st.integers(1, 10))):
            rpc, msg, at_real = _hostile(data.draw, pool)
            code, details = loop.run_until_complete(kv.call(rpc, msg))
            want = _fault(rpc, msg)

            def what(rpc=rpc, msg=msg, code=code, details=details) -> str:
                return f"{rpc} {str(msg)[:200]!r}: {code.name} {details[:200]}"

            if want is not None or at_real:
                assert at_real <= (want is not None)
                assert (code, details.partition(":")[0]) == (IA, want), what()
                outcome = "refused"
            elif rpc == "PublishCacheEvents":  # a phantom's events: applied, or not registered
                assert code in (OK, NF), what()
                outcome = "accepted" if code is OK else "unregistered"
            else:
                assert code is OK, what()
                outcome = "accepted"
            key = f"{rpc}:{outcome}"
            counts[key] = counts.get(key, 0) + 1
        after, phantoms = loop.run_until_complete(_view(kv))
        assert after == before, "a hostile call changed what kvstore answers of the real instances"
        for iid, info in phantoms.items():
            req = pb.RegisterInstanceRequest(
                ref=info.ref, block_size=info.block_size, model=info.model, ttl_ms=1
            )
            assert _register_fault(req) is None, f"kvstore holds an invalid instance {iid!r}"
        next(examples)

    try:
        batch()
    finally:
        loop.run_until_complete(kv.stop())
        loop.close()
    ran = next(examples)
    print(f"kvstore hostile calls: {ran} batches, {sum(counts.values())} calls, {counts}")
    assert ran >= EXAMPLES // 2
    assert counts.get("RegisterInstance:accepted", 0) > 0  # phantoms did get in ...
    assert sum(v for k, v in counts.items() if k.endswith(":refused")) > EXAMPLES  # ... and out
