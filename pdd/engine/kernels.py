"""The engine's compiled CPU kernels: one library built from ``csrc/*.cpp`` on first use.

``csrc/paged_decode.cpp`` (decode attention read in place from the paged pool) and
``csrc/fused_ops.cpp`` (RMSNorm with the residual add, SiLU·mul, RoPE in place) and
``csrc/decode_forward.cpp`` (a whole decode step's forward in one call, on those) and
``csrc/argmax_rows.cpp`` (greedy sampling's first maximum per row) and ``csrc/panel_gemm.cpp``
(decode-sized matmuls on weights in 16-column panels, ``panel_gemm``) are compiled
together with ``torch.utils.cpp_extension`` (a C++ compiler and ninja are needed; ~15 s) into
``pdd_kernels-torch<version>/`` under ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``): later processes load the built library in well under a second,
and a changed source is rebuilt. It registers ``torch.ops.pdd.*``. Processes that start together
build it once (a file lock). A failed build is not retried in the same process; its users
(``paged_decode``, ``fused``) fall back to eager PyTorch and say why.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    CSRC / "paged_decode.cpp",
    CSRC / "fused_ops.cpp",
    CSRC / "decode_forward.cpp",
    CSRC / "argmax_rows.cpp",
    CSRC / "panel_gemm.cpp",
)

_lock = threading.Lock()
_loaded = False
_build_error: Exception | None = None
_logged: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Use:
    """One user of the kernels: its off switch and how it names its choice in the log."""

    env_switch: str  # an operator's off switch: ``<env_switch>=0``
    event: str  # logged once when the kernels are used
    fallback_event: str  # logged once per reason when they are not
    path: str  # the path taken with the kernels
    fallback_path: str  # the path taken without them


def enabled(
    use: Use,
    requested: bool,
    device: torch.device,
    dtype: torch.dtype,
    unsupported: Callable[[], str] | None = None,
) -> bool:
    """Whether ``use`` should run on the kernels here (building them if needed); logs why once.

    ``unsupported``, asked once the kernels are loaded: why this machine cannot run ``use``
    (e.g. a missing instruction set), or "" when it can."""
    error = ""
    if not requested:
        reason = "disabled_by_config"
    elif os.environ.get(use.env_switch, "1") == "0":
        reason = f"disabled_by_{use.env_switch}"
    elif device.type != "cpu":
        reason = f"device_{device.type}"
    elif dtype != torch.float32:
        reason = f"dtype_{str(dtype).removeprefix('torch.')}"
    else:
        try:
            load()
            reason = unsupported() if unsupported is not None else ""
        except Exception as exc:
            reason, error = "build_failed", str(exc)[-2000:]
    if (use.event, reason) not in _logged:
        _logged.add((use.event, reason))
        if not reason:
            log.info(use.event, path=use.path)
        elif error:
            log.warning(use.fallback_event, path=use.fallback_path, reason=reason, error=error)
        else:
            log.info(use.fallback_event, path=use.fallback_path, reason=reason)
    return not reason


def load() -> None:
    """Build (or reuse the cached build) and register the ops; raises if the build fails."""
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
        ) as exc:  # compiler or ninja missing, or a compile error: kept for the report
            _build_error = exc
            raise
        _loaded = True


def loaded() -> bool:
    """Whether the ops are registered in this process (never builds them)."""
    return _loaded


def build_directory() -> Path:
    """Where the kernels are built and cached (one per torch version)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / f"pdd_kernels-torch{torch.__version__}"


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
        # NOTE: -O3 without -march=native: the cache may be shared between machines; each kernel
        # carries its own AVX-512 / AVX2 / baseline clones, chosen at load time. at::parallel_for
        # is inline OpenMP code: without -fopenmp it silently runs on one thread (the libgomp it
        # links is the one torch has already loaded: same soname).
        build_extension(
            name="pdd_kernels",
            sources=[str(source) for source in SOURCES],
            extra_include_paths=[str(CSRC)],
            build_directory=str(directory),
            extra_cflags=["-O3", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
