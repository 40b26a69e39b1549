"""Fixtures shared by every test tier.

``redis_url`` is a real Redis server: the one named by ``PDD_TEST_REDIS_URL``,
else a private ``redis-server`` started for the session on a free port.
Tests isolate themselves with a unique key prefix (``key_prefix``).

Engine test fixtures: tiny random checkpoints and the ``transformers`` oracle on the same weights.

``llama_oracle(ckpt)`` saves the checkpoint as a Hugging Face directory and loads
it with ``transformers``; ``Oracle.assert_greedy_equal`` compares our greedy
tokens with its ``generate(do_sample=False)``. The one accepted difference is a
*near-tie*: at the first differing position the oracle's top-2 logit margin is
below ``NEAR_TIE`` (two correct float paths may order a tie either way); the
helper then says so with a ``NearTieDivergence`` warning and stops comparing.
Any other difference fails.
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import structlog
import torch

# NOTE: one definition of a near-tie, shared with the benchmark's output-agreement check.
from pdd.bench.agreement import NEAR_TIE
from pdd.engine.checkpoint_record import Checkpoint
from pdd.testbed.launcher import free_port  # noqa: F401 — tests import it from here

ROOT = Path(__file__).resolve().parent.parent


# The compiled kernels' tests (``pytestmark = NEEDS_KERNELS``): they fail, not skip, when the build
# fails on a machine with a C++ compiler (a broken build must not pass as a skip), and are skipped
# only where no compiler exists at all (the engine then runs eager PyTorch).
NEEDS_KERNELS = [
    pytest.mark.skipif(
        shutil.which(os.environ.get("CXX", "c++")) is None,
        reason="no C++ compiler: the engine runs eager PyTorch",
    ),
    pytest.mark.usefixtures("kernels_built"),
]


@pytest.fixture(scope="session")
def kernels_built() -> None:
    from pdd.engine import kernels

    kernels.load()  # raises (fails every test that uses it) when the build fails


@pytest.fixture(autouse=True)
def _fresh_logging() -> Iterator[None]:
    """A test that runs a command in-process (``pdd ... main([...])``) configures structlog to
    print to that test's captured stderr; later tests must not log into the closed capture."""
    yield
    if structlog.is_configured():
        structlog.reset_defaults()
        structlog.contextvars.clear_contextvars()


@pytest.fixture(autouse=True)
def _cpus_given_back() -> Iterator[None]:
    """A test that benchmarks in-process pins the test process (the bench client) to a cluster's
    CPUs; it must give them back, or later tests run on fewer CPUs than they were collected for."""
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    yield
    if before is not None:
        after = os.sched_getaffinity(0)
        if after != before:
            os.sched_setaffinity(0, before)  # NOTE: later tests must not fail for this one
            pytest.fail(f"the test left this process on CPUs {sorted(after)}, not {sorted(before)}")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if url := os.environ.get("PDD_TEST_REDIS_URL"):
        yield url
        return
    from pdd.core.errors import UnavailableError
    from pdd.prefix_index.redis_server import start_redis

    try:
        proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    except UnavailableError as exc:
        pytest.fail(f"{exc} (make system-deps installs redis-server)")
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def key_prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


class NearTieDivergence(UserWarning):
    """Two float paths chose differently where the reference's top-2 logits were within NEAR_TIE."""


class Oracle:
    def __init__(self, model) -> None:
        self.model = model

    @torch.inference_mode()
    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([list(prompt)])
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        return out[0, len(prompt) :].tolist()

    @torch.inference_mode()
    def next_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """The oracle's logits for the token after ``tokens`` → ``[V]`` float32."""
        return self.model(torch.tensor([list(tokens)])).logits[0, -1].float()

    def margin(self, tokens: Sequence[int]) -> float:
        top = self.next_logits(tokens).topk(2).values
        return float(top[0] - top[1])

    def assert_engines_agree(
        self, ours, reference, prompts: Sequence[Sequence[int]], params
    ) -> None:
        """Engine ``ours`` generates what engine ``reference`` does, prompt by prompt, up to a
        near-tie of this oracle (two float paths of one engine, e.g. a kernel on and off)."""
        pairs = zip(ours.generate(prompts, params), reference.generate(prompts, params))
        for prompt, (a, b) in zip(prompts, pairs, strict=True):
            self.assert_greedy_equal(prompt, a, b)

    def assert_greedy_equal(
        self, prompt: Sequence[int], ours: Sequence[int], reference: Sequence[int] | None = None
    ) -> None:
        """``ours`` equals ``reference`` (default: the oracle's greedy tokens), up to a near-tie."""
        reference = list(reference) if reference is not None else self.generate(prompt, len(ours))
        assert len(ours) == len(reference), (
            f"{len(ours)} tokens vs {len(reference)} in the reference"
        )
        for i, (a, b) in enumerate(zip(ours, reference)):
            if a == b:
                continue
            margin = self.margin(list(prompt) + list(reference[:i]))
            assert margin < NEAR_TIE, (
                f"greedy tokens differ at output {i}: ours {list(ours)} vs reference {list(reference)}; "
                f"the reference's top-2 margin there is {margin:.3g}, not a near-tie (< {NEAR_TIE})"
            )
            warnings.warn(
                NearTieDivergence(
                    f"accepted divergence at output {i} (ours {a}, reference {b}): the reference's top-2 logit "
                    f"margin is {margin:.3g} < {NEAR_TIE}, a near-tie; later tokens are not compared"
                ),
                stacklevel=2,
            )
            return


@pytest.fixture(scope="session")
def llama_oracle(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Checkpoint], Oracle]:
    """``llama_oracle(ckpt)`` → the transformers model on ``ckpt``'s weights (cached per checkpoint)."""
    from transformers import AutoModelForCausalLM

    cache: dict[int, tuple[Checkpoint, Oracle]] = {}  # holds ckpt so its id is never reused

    def make(ckpt: Checkpoint) -> Oracle:
        if id(ckpt) not in cache:
            path = ckpt.save_hf(tmp_path_factory.mktemp("hf_model"))
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
            cache[id(ckpt)] = (ckpt, Oracle(model))
        return cache[id(ckpt)][1]

    return make
