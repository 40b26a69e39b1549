"""Fast-link transport over RDMA: one-sided RDMA WRITE through ``pyverbs``.

Only the verbs calls live here — registering a region, bringing a reliable-
connected queue pair up, posting writes and polling their completions. The
handshake, leases, completion CRC and cleanup are ``receiver.py`` /
``sender.py``, shared with the shared-memory transport and tested through it.

``pyverbs`` is Debian's ``python3-pyverbs`` (not on PyPI); where it is missing
or finds no device, ``rdma_devices()`` is empty and ``select_transport`` never
picks RDMA. Importing this module never fails.

Contract gap (see the KV transport report): a reliable-connected QP needs the
*sender's* QP facts on the relay before the relay's QP can go to RTR, and
``PrepareTransferRequest`` carries none. Until it does, the caller connects the
two QPs out of band with ``RdmaReceiverBackend.connect`` /
``RdmaSenderBackend.endpoint`` once per (prefill, relay) pair.

NOTE: untested here — these machines have no RDMA device and no Soft-RoCE.
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import random

from pdd.core.errors import UnavailableError
from pdd.kv.fast_link.region import RdmaEndpointInfo, Reservation
from pdd.kv.fast_link.state import Transport
from pdd.kv.transfer import TransferHeader

try:  # pragma: no cover - exercised only where python3-pyverbs is installed
    import pyverbs.device as _device
    import pyverbs.enums as _e
    from pyverbs.addr import AHAttr, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, SendWR
except ImportError:
    _device = None

_PORT = 1
_GID_INDEX = 0
_MAX_WR = 64


def pyverbs_available() -> bool:
    return _device is not None


def rdma_devices() -> tuple[str, ...]:
    """Names of the RDMA devices ``pyverbs`` sees; empty without pyverbs or devices."""
    if _device is None:
        return ()
    try:  # pragma: no cover - needs pyverbs
        return tuple(d.name.decode() for d in _device.get_device_list())
    except Exception:  # noqa: BLE001 — any verbs failure means "no usable device"
        return ()


class _Verbs:  # pragma: no cover - needs an RDMA device
    """A device context, protection domain, completion queue and one RC queue pair."""

    def __init__(self, device: str | None) -> None:
        names = rdma_devices()
        if not names:
            raise UnavailableError("no RDMA device (pyverbs missing or no device found)")
        self.ctx = _device.Context(name=device or names[0])
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, _MAX_WR)
        cap = QPCap(max_send_wr=_MAX_WR, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(self.pd, QPInitAttr(qp_type=_e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
        self.psn = random.getrandbits(24)
        port = self.ctx.query_port(_PORT)
        self.lid = port.lid
        self.gid = self.ctx.query_gid(_PORT, _GID_INDEX)

    def endpoint(self, remote_addr: int = 0, rkey: int = 0) -> RdmaEndpointInfo:
        return RdmaEndpointInfo(
            remote_addr,
            rkey,
            self.qp.qp_num,
            self.lid,
            bytes.fromhex(self.gid.gid.replace(":", "")),
            self.psn,
        )

    def connect(self, peer: RdmaEndpointInfo) -> None:
        """INIT → RTR (towards ``peer``) → RTS."""
        attr = QPAttr(port_num=_PORT)
        attr.qp_access_flags = _e.IBV_ACCESS_REMOTE_WRITE | _e.IBV_ACCESS_LOCAL_WRITE
        gr = GlobalRoute(dgid=_gid_from_bytes(peer.gid), sgid_index=_GID_INDEX)
        attr.ah_attr = AHAttr(gr=gr, is_global=1, port_num=_PORT, dlid=peer.lid)
        attr.dest_qp_num = peer.qp_num
        attr.rq_psn = peer.psn
        attr.sq_psn = self.psn
        attr.path_mtu = _e.IBV_MTU_1024
        self.qp.to_init(attr)
        self.qp.to_rtr(attr)
        self.qp.to_rts(attr)


def _gid_from_bytes(raw: bytes):  # pragma: no cover - needs pyverbs
    from pyverbs.addr import GID

    text = raw.hex()
    return GID(":".join(text[i : i + 4] for i in range(0, 32, 4)))


class RdmaRegion:  # pragma: no cover - needs an RDMA device
    shm_name = ""

    def __init__(self, verbs: _Verbs, nbytes: int) -> None:
        self._buffer = mmap.mmap(-1, max(nbytes, 1))
        address = ctypes.addressof(ctypes.c_char.from_buffer(self._buffer))
        self._mr = MR(
            verbs.pd,
            max(nbytes, 1),
            _e.IBV_ACCESS_LOCAL_WRITE | _e.IBV_ACCESS_REMOTE_WRITE,
            address=address,
        )
        self._nbytes = nbytes
        self.rdma = verbs.endpoint(address, self._mr.rkey)

    @property
    def view(self) -> memoryview:
        return memoryview(self._buffer)[: self._nbytes]

    def close(self, reuse: bool = False) -> None:
        if self._mr is not None:
            self._mr.close()
            self._mr = None


class RdmaReceiverBackend:  # pragma: no cover - needs an RDMA device
    transport = Transport.RDMA

    def __init__(self, device: str | None = None) -> None:
        self._verbs = _Verbs(device)

    def connect(self, sender: RdmaEndpointInfo) -> RdmaEndpointInfo:
        """Bring the relay's QP up towards a sender's; returns the relay's QP facts."""
        self._verbs.connect(sender)
        return self._verbs.endpoint()

    def allocate(self, transfer_id: str, nbytes: int) -> RdmaRegion:
        return RdmaRegion(self._verbs, nbytes)


class RdmaWriter:  # pragma: no cover - needs an RDMA device
    """Posts one signalled RDMA WRITE per chunk from a registered staging buffer."""

    def __init__(self, verbs: _Verbs, reservation: Reservation) -> None:
        if reservation.rdma is None:
            raise UnavailableError("the reservation carries no RDMA endpoint")
        self._verbs = verbs
        self._remote = reservation.rdma
        self._staging = MR(verbs.pd, max(reservation.total_bytes, 1), _e.IBV_ACCESS_LOCAL_WRITE)
        self._posted = 0

    async def write(self, index: int, offset: int, data: memoryview) -> None:
        self._staging.write(bytes(data), data.nbytes, offset)
        wr = SendWR(
            opcode=_e.IBV_WR_RDMA_WRITE,
            num_sge=1,
            sg=[SGE(self._staging.buf + offset, data.nbytes, self._staging.lkey)],
            send_flags=_e.IBV_SEND_SIGNALED,
        )
        wr.set_wr_rdma(self._remote.rkey, self._remote.remote_addr + offset)
        while self._posted >= _MAX_WR:
            await self._reap()
        self._verbs.qp.post_send(wr)
        self._posted += 1

    async def _reap(self) -> None:
        n, wcs = self._verbs.cq.poll(num_entries=_MAX_WR)
        for wc in wcs[:n]:
            if wc.status != _e.IBV_WC_SUCCESS:
                raise UnavailableError(f"RDMA write failed: work completion status {wc.status}")
        self._posted -= n
        if n == 0:
            await asyncio.sleep(0)

    async def finish(self) -> None:
        while self._posted:
            await self._reap()

    def close(self) -> None:
        self._staging.close()


class RdmaSenderBackend:  # pragma: no cover - needs an RDMA device
    transport = Transport.RDMA

    def __init__(self, device: str | None = None) -> None:
        self._verbs = _Verbs(device)

    def endpoint(self) -> RdmaEndpointInfo:
        """This sender's QP facts, for ``RdmaReceiverBackend.connect`` on the relay."""
        return self._verbs.endpoint()

    def connect(self, relay: RdmaEndpointInfo) -> None:
        self._verbs.connect(relay)

    async def open(self, reservation: Reservation, header: TransferHeader) -> RdmaWriter:
        return RdmaWriter(self._verbs, reservation)
