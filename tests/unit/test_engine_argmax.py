"""Greedy sampling's compiled pick (``csrc/argmax_rows.cpp``) against ``torch.max(dim).indices``.

The same token on every input, not nearly: ties (first maximum wins, within a vector lane and
across lanes), NaN (first NaN wins), infinities, rows shorter than a vector, ragged tails,
non-contiguous logits; and ``sampling.greedy_tokens`` takes it once the kernels are loaded.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdd.engine import kernels, sampling
from tests.conftest import NEEDS_KERNELS

pytestmark = NEEDS_KERNELS


@pytest.fixture(scope="module", autouse=True)
def built():
    kernels.load()


def _same(x: torch.Tensor) -> None:
    got = torch.ops.pdd.argmax_rows(x)
    want = x.max(dim=-1).indices
    assert got.dtype == torch.long
    assert torch.equal(got, want), (got.tolist(), want.tolist())


@pytest.mark.parametrize("vocab", [1, 3, 15, 16, 17, 31, 33, 1000, 32000, 32001])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_random_rows(rows, vocab):
    gen = torch.Generator().manual_seed(rows * 100003 + vocab)
    _same(torch.randn(rows, vocab, generator=gen))


def test_ties_pick_the_first_maximum():
    x = torch.zeros(6, 100)
    x[0, [7, 23, 39]] = 5.0  # the same lane (7 mod 16), three blocks
    x[1, [40, 9, 90]] = 5.0  # different lanes, the first not in the first block
    x[2, [98, 99]] = 5.0  # only in the scalar tail
    x[3, [3, 99]] = 5.0  # vector part and tail
    x[4] = 1.0  # every position ties
    x[5, 0] = -0.0  # -0.0 and 0.0 tie: the first
    _same(x)
    assert torch.ops.pdd.argmax_rows(x).tolist() == [7, 9, 98, 3, 0, 0]


def test_nan_and_infinities():
    x = torch.randn(6, 70)
    x[0, 50] = math.nan  # NaN beats any number
    x[1, [20, 5]] = math.nan  # the first NaN
    x[2, 66] = math.nan  # in the tail
    x[3, [10, 40]] = math.inf
    x[4] = -math.inf
    x[5, 12], x[5, 60] = math.inf, math.nan
    _same(x)


def test_non_contiguous_and_empty():
    x = torch.randn(64, 40)
    _same(x.t())  # [40, 64], column-major
    _same(x[::3])
    _same(torch.empty(0, 32))


def test_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="CPU float32"):
        torch.ops.pdd.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"\[N, V\]"):
        torch.ops.pdd.argmax_rows(torch.zeros(3))


def test_greedy_tokens_take_it_and_agree(monkeypatch):
    x = torch.randn(16, 32000, generator=torch.Generator().manual_seed(3))
    calls = []
    real = torch.ops.pdd.argmax_rows

    class Spy:
        def __call__(self, t):
            calls.append(t.shape)
            return real(t)

    monkeypatch.setattr(torch.ops.pdd, "argmax_rows", Spy())
    assert sampling.greedy_tokens(x) == x.max(dim=-1).indices.tolist()
    assert calls == [torch.Size([16, 32000])]
    assert sampling.greedy_tokens(x.double()) == x.max(dim=-1).indices.tolist()
    assert len(calls) == 1  # NOTE: float64 takes ATen's path
