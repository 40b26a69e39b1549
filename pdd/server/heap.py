"""glibc's malloc told to keep the buffers a KV transfer frees (every service calls ``tune``).

A KV push churns through buffers of a megabyte or more on both ends: a chunk's bytes, its
protobuf, gRPC's slices. By default glibc hands such a buffer back to the kernel when it is
freed (its mmap threshold follows the sizes it has seen; the heap's top is trimmed once 128 KiB
of it is free), so the next buffer faults every page in again, zero-filled. Measured (two
processes on this project's 2-core host, 16 pushes of 2.6 MB over gRPC): ~20,000 page faults
and 40-45 ms of the sender's CPU per 42 MB, 1 GB/s; with blocks up to ``MMAP_THRESHOLD`` served
from the heap and up to ``TRIM_THRESHOLD`` of free heap kept for the next transfer: ~0 faults,
16-20 ms, 2 GB/s. In the served benchmark's stack (P-MD, 16 requests) rounds took 1069-1137 ms
against 1091-1193 without.

The cost is memory: a process keeps up to ``TRIM_THRESHOLD`` of freed heap (per malloc arena)
instead of returning it — the high-water mark of its transfers in flight, as jemalloc or
tcmalloc would keep it. Blocks over ``MMAP_THRESHOLD`` still come from and go back to mmap.

protobuf's Python runtime (upb) undoes that on its own: every 10,000 frees of its messages'
arena blocks it calls ``malloc_trim(0)``, which hands every free page of every arena back to
the kernel — the heap kept for the next transfer included. Any process that sends or receives
messages at a few thousand a second trims every few seconds: MainDecode faulted ~10,000 pages
(40 MB: a whole P-MD burst's KV) back in per round of the served benchmark, and a freed 24 MB
of heap re-touched after 30,000 messages faults all of it. ``tune`` therefore also points upb's
own ``malloc_trim`` import at a function that does nothing with it (``abs``: ``malloc_trim(0)``
becomes ``abs(0)``), through its GOT slot (``elf_got``); only upb's calls change. Where that
cannot be done (not ELF x86-64/AArch64, upb not the backend) the tuning stands and the log
says why.

An operator's own choice wins: with any of ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``
or ``GLIBC_TUNABLES`` in the environment nothing is changed, and ``PDD_MALLOC_TUNING=0`` turns
this off. Without glibc (musl, macOS) there is nothing to tune.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
from collections.abc import Mapping

import structlog

from pdd.server import elf_got

log = structlog.get_logger(__name__)

# mallopt(3) parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# NOTE: 32 MiB is glibc's ceiling for the mmap threshold on 64-bit hosts (a larger value is
# refused); it covers a KV chunk, its protobuf and a gRPC message of the default chunk size.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20
ENV_SWITCH = "PDD_MALLOC_TUNING"
OPERATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def left_alone(env: Mapping[str, str]) -> str | None:
    """Why malloc is not to be tuned in this environment, or None."""
    if env.get(ENV_SWITCH, "1") == "0":
        return f"disabled_by_{ENV_SWITCH}"
    given = [name for name in OPERATOR_ENV if name in env]
    return f"operator_set_{given[0]}" if given else None


def tune(env: Mapping[str, str] | None = None) -> bool:
    """Serve blocks up to ``MMAP_THRESHOLD`` from the heap and keep ``TRIM_THRESHOLD`` of it free;
    True if glibc took both settings. Logged once either way."""
    reason = left_alone(os.environ if env is None else env)
    if reason is None:
        name = ctypes.util.find_library("c")
        try:
            mallopt = ctypes.CDLL(name).mallopt if name else None
        except (OSError, AttributeError):
            mallopt = None
        if mallopt is None:
            reason = "no_glibc_mallopt"
        elif not (
            mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        ):
            reason = "mallopt_refused"
    if reason is not None:
        log.info("malloc_left_alone", reason=reason)
        return False
    log.info(
        "malloc_tuned",
        mmap_threshold=MMAP_THRESHOLD,
        trim_threshold=TRIM_THRESHOLD,
        upb_trim=keep_upb_from_trimming(),
    )
    return True


def keep_upb_from_trimming() -> str:
    """Point upb's ``malloc_trim`` calls at ``abs`` (see the module's docstring); what was done."""
    try:
        import google._upb._message as upb
    except ImportError:
        return "no_upb"
    try:
        noop = ctypes.cast(ctypes.CDLL(None).abs, ctypes.c_void_p).value
        if noop is None:
            return "no_abs"
        return "disarmed" if elf_got.redirect(upb.__file__, "malloc_trim", noop) else "not_used"
    except (LookupError, OSError, ValueError, IndexError, struct.error) as exc:
        return f"left_as_is: {exc}"
