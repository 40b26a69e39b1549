"""The paged decode-attention kernel: decode queries read K/V in place from the pool by block table.

``csrc/paged_decode.cpp`` is compiled with ``torch.utils.cpp_extension`` on first use (a C++
compiler and ninja are needed; ~10 s) into ``pdd_paged_decode-torch<version>/`` under
``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``): later processes load the built
library in well under a second, and a changed source is rebuilt. It registers
``torch.ops.pdd.paged_decode``. Processes that start together build it once (a file lock).

An engine uses it when ``EngineConfig.paged_decode_kernel`` is set (the default), the pool is CPU
float32, ``PDD_PAGED_KERNEL`` is not ``0`` (an operator's off switch) and the build succeeds;
otherwise decode takes the gather + SDPA path of ``attention``. Which path, and why, is logged
once per reason. A failed build is not retried in the same process.
"""

from __future__ import annotations

import fcntl
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode.cpp"
ENV_SWITCH = "PDD_PAGED_KERNEL"

_lock = threading.Lock()
_loaded = False
_build_error: Exception | None = None
_logged: set[str] = set()


def load() -> None:
    """Build (or reuse the cached build) and register the op; raises if the build fails."""
    global _loaded, _build_error
    with _lock:
        if _loaded:
            return
        if _build_error is not None:
            raise _build_error
        try:
            _build()
        except (
            Exception
        ) as exc:  # compiler or ninja missing, or a compile error: keep it for the report
            _build_error = exc
            raise
        _loaded = True


def build_directory() -> Path:
    """Where the kernel is built and cached (one per torch version)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / f"pdd_paged_decode-torch{torch.__version__}"


def _build() -> None:
    from torch.utils.cpp_extension import load as build_extension

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "pdd_build.lock", "w") as lock:
        # NOTE: torch's own build lock is a plain file: a builder killed mid-build leaves it behind
        # and every later process waits on it forever. An flock dies with its process, and while
        # we hold it no one else is building, so torch's file, if there, is stale.
        fcntl.flock(lock, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        # NOTE: -O3 without -march=native: the cache may be shared between machines; the kernel
        # carries its own AVX-512 / AVX2 / baseline clones, chosen at load time. at::parallel_for
        # is inline OpenMP code: without -fopenmp it silently runs on one thread (the libgomp it
        # links is the one torch has already loaded: same soname).
        build_extension(
            name="pdd_paged_decode",
            sources=[str(SOURCE)],
            build_directory=str(directory),
            extra_cflags=["-O3", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )


def enabled(requested: bool, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether an engine with this pool should decode with the kernel (building it if needed)."""
    if not requested:
        reason = "disabled_by_config"
    elif os.environ.get(ENV_SWITCH, "1") == "0":
        reason = f"disabled_by_{ENV_SWITCH}"
    elif device.type != "cpu":
        reason = f"device_{device.type}"
    elif dtype != torch.float32:
        reason = f"dtype_{str(dtype).removeprefix('torch.')}"
    else:
        try:
            load()
            reason = None
        except Exception as exc:
            _log_once(
                "build_failed",
                log.warning,
                "paged_decode_fallback",
                path="gather_sdpa",
                reason="build_failed",
                error=str(exc)[-2000:],
            )
            return False
    if reason is None:
        _log_once("kernel", log.info, "paged_decode_kernel", path="paged_kernel")
        return True
    _log_once(reason, log.info, "paged_decode_fallback", path="gather_sdpa", reason=reason)
    return False


def paged_decode(
    q: torch.Tensor, blocks: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor
) -> torch.Tensor:
    """``q [B, H, D]`` against ``blocks [NB+1, bs, 2, KV, D]`` by ``block_tables [B, MB]`` → ``[B, H, D]``.

    Sequence ``b`` attends to its first ``context_lens[b]`` tokens; scale ``1/sqrt(D)`` as SDPA's.
    """
    return torch.ops.pdd.paged_decode(
        q, blocks, block_tables, context_lens, 1.0 / math.sqrt(q.shape[-1])
    )


def _log_once(key: str, emit: Callable[..., object], event: str, **fields: object) -> None:
    if key not in _logged:
        _logged.add(key)
        emit(event, **fields)
