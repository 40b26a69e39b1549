"""``pdd bench served``'s settings (``ServedConfig``) and the contenders it can name.

Every rule on the settings lives in ``ServedConfig.__post_init__`` (a ValueError naming the
field); the command line (``served._parse``) only reads them.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pdd.bench.served_contenders import ON_B, STACK_CONTENDERS, VLLM_STACK_CONTENDERS
from pdd.testbed.placement import Placement

DEFAULT_CONTENDERS = (*STACK_CONTENDERS, "engine", "vllm")
# NOTE: the stack on vLLM is chosen by name only: three more vLLM starts (minutes each on 2 cores).
CONTENDERS = (*DEFAULT_CONTENDERS, *VLLM_STACK_CONTENDERS)
REFERENCE = "vllm"
# Whatever needs the vLLM venv's Python: its server, and the stack whose services run vLLM.
NEEDS_VLLM = ("vllm", *VLLM_STACK_CONTENDERS)
# What ``--py-spy`` can profile: the first of these chosen (a stack, on our engine or vLLM).
PROFILED = (*STACK_CONTENDERS, *VLLM_STACK_CONTENDERS)
# What ``--b-env`` may name: a POSIX shell's variable name.
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class ServedConfig:
    concurrency: tuple[int, ...] = (1, 16, 32, 64)
    contenders: tuple[str, ...] = DEFAULT_CONTENDERS
    prompt_len: int = 128
    output_len: int = 64
    rounds: int = 3
    # torch threads of every engine (ours in-process, the stack's, vLLM's OpenMP binding).
    threads: int = 2
    # A Hugging Face directory; "" = the random Llama below, written once.
    model: str = ""
    vllm_python: str = ".venv-vllm/bin/python"
    # Extra flags of vLLM's server (e.g. ("--distributed-executor-backend", "uni")).
    vllm_serve_flags: tuple[str, ...] = ()
    vllm_startup_s: float = 900.0
    request_timeout_s: float = 600.0
    quiet_threshold: float = 0.15
    quiet_max_wait_s: float = 30.0
    # A py-spy binary: profile every stack process over the measured rounds ("" = no profile).
    py_spy: str = ""
    # CPUs kept for the frontends (``StackConfig.frontend_cpus``), the same for every contender:
    # the stack's services there, its engines' steps on the rest; our engine in-process steps on
    # the rest, the bench's client there; vLLM's OpenMP bound to the rest, its API server there.
    frontend_cpus: int = 0
    # Stack B's services' extra environment ((name, value), ...): the ``@b`` contenders.
    b_env: tuple[tuple[str, str], ...] = ()
    # Stack B runs the code of this checkout ("" = this one): another commit against this one
    # (``git worktree add DIR COMMIT``), the same noise, rounds alternating.
    b_code: str = ""

    def __post_init__(self) -> None:
        if not self.concurrency or any(n < 1 for n in self.concurrency):
            raise ValueError(f"concurrency: each must be >= 1, got {list(self.concurrency)}")
        unknown = [c for c in self.contenders if c.removesuffix(ON_B) not in CONTENDERS]
        on_b = [c for c in self.contenders if c.endswith(ON_B)]
        if not self.contenders or unknown:
            raise ValueError(
                f"contenders: choose from {', '.join(CONTENDERS)} (a stack's also with {ON_B}: "
                f"served by stack B), got {','.join(self.contenders)}"
            )
        if not_stack := [c for c in on_b if c.removesuffix(ON_B) not in STACK_CONTENDERS]:
            raise ValueError(
                f"contenders: {ON_B} names a stack contender run on stack B, "
                f"not {','.join(not_stack)}"
            )
        for name in ("b_env", "b_code"):
            if getattr(self, name) and not on_b:
                raise ValueError(
                    f"{name}: no contender runs on stack B; name one as grpc-p-md{ON_B} (say)"
                )
        for key, _ in self.b_env:
            if not ENV_NAME.fullmatch(key):
                raise ValueError(f"b_env: {key!r} is not an environment variable's name")
        if self.b_code:
            code = Path(self.b_code)
            if not (code / "pdd" / "__init__.py").is_file() or not (code / "services").is_dir():
                raise ValueError(
                    f"b_code: {self.b_code} is not a PDD checkout (no pdd/, services/)"
                )
        if len(set(self.contenders)) != len(self.contenders):
            raise ValueError(f"contenders: named twice in {','.join(self.contenders)}")
        for name in ("prompt_len", "output_len", "rounds", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.prompt_len < 2:
            raise ValueError(
                f"prompt_len: must be >= 2 (two tokens hold the counter), got {self.prompt_len}"
            )
        for name in ("vllm_startup_s", "request_timeout_s", "quiet_max_wait_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if not 0 <= self.quiet_threshold <= 1:
            raise ValueError(f"quiet_threshold: must be in [0, 1], got {self.quiet_threshold}")
        if set(NEEDS_VLLM) & set(self.contenders) and not os.access(self.vllm_python, os.X_OK):
            raise ValueError(
                f"vllm_python: {self.vllm_python}: not an executable (make vllm-venv builds it)"
            )
        if self.py_spy and not os.access(self.py_spy, os.X_OK):
            raise ValueError(f"py_spy: {self.py_spy}: not an executable")
        if self.py_spy and not set(self.contenders) & set(PROFILED):
            raise ValueError(f"py_spy: profiles the stack; choose one of {','.join(PROFILED)}")
        if self.model and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model: {self.model}: not a Hugging Face directory (no config.json)")
        if self.frontend_cpus:
            placement = Placement.keeping(self.frontend_cpus)
            assert placement is not None
            if self.threads > len(placement.engine):
                raise ValueError(
                    f"threads: must be <= the {len(placement.engine)} CPUs --frontend-cpus "
                    f"{self.frontend_cpus} leaves the engines, got {self.threads}"
                )
            placed_not = set(self.contenders) & set(VLLM_STACK_CONTENDERS)
            if placed_not:
                raise ValueError(
                    f"frontend_cpus: not for {','.join(sorted(placed_not))} (the stack on vLLM)"
                )

    def stack_b_env(self) -> dict[str, str]:
        """Stack B's services' extra environment: ``b_env``, and with ``b_code`` what makes
        them import that checkout (``-m`` puts the working directory first on ``sys.path``
        unless ``PYTHONSAFEPATH``) and build its kernels apart from this one's."""
        env = dict(self.b_env)
        if self.b_code:
            code = Path(self.b_code).resolve()
            tag = hashlib.sha1(str(code).encode()).hexdigest()[:10]
            env |= {
                "PYTHONSAFEPATH": "1",
                "PYTHONPATH": str(code),
                "TORCH_EXTENSIONS_DIR": str(Path(tempfile.gettempdir()) / f"pdd-kernels-{tag}"),
            }
        return env
