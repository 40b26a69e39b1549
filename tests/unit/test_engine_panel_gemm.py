"""``panel_gemm``: decode-sized matmuls on 16-column weight panels (``csrc/panel_gemm.cpp``).

It must compute ``x @ W + b`` (against float64), pad a last partial panel without writing past
the output, serve ``Linear`` only up to ``MAX_EXACT_ROWS`` rows, be switched off by config and
by ``PDD_PANEL_GEMM=0``, and refuse malformed inputs naming the op and the field.
"""

from __future__ import annotations

import pytest
import torch

from pdd.engine import Engine, EngineConfig, SamplingParams, panel_gemm, tiny_model
from pdd.engine.linear import Linear
from tests.conftest import NEEDS_KERNELS

pytestmark = [
    *NEEDS_KERNELS,
    pytest.mark.skipif(
        "avx512f" not in open("/proc/cpuinfo").read(), reason="the panel kernel needs AVX-512F"
    ),
]


def _reference(x, weight_t, bias):
    out = x.double() @ weight_t.double()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40, 64])
# (64, 4100): 257 panels in runs of 64, more runs than threads, the last run and panel partial
@pytest.mark.parametrize("k,n", [(8, 16), (100, 40), (512, 96), (1536, 33), (64, 4100)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_it_multiplies_as_float64_does(rows, k, n, with_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=gen)
    weight_t = torch.randn(k, n, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    panels = panel_gemm.pack(weight_t)
    assert panels.shape == (-(-n // 16), k, 16)
    got = panel_gemm.linear(x, panels, bias, n)
    assert got.shape == (rows, n) and got.is_contiguous()
    torch.testing.assert_close(got.double(), _reference(x, weight_t, bias), rtol=1e-5, atol=1e-4)


def test_a_partial_last_panel_writes_only_its_columns():
    x, weight_t = torch.randn(3, 64)[:, ::2], torch.randn(32, 20)  # a strided x too
    out = panel_gemm.linear(x, panel_gemm.pack(weight_t), None, 20)
    torch.testing.assert_close(out.double(), _reference(x, weight_t, None), rtol=1e-5, atol=1e-5)
    assert panel_gemm.linear(x[:0], panel_gemm.pack(weight_t), None, 20).shape == (0, 20)


def test_a_call_does_not_read_what_an_earlier_one_left_behind():
    """x is transposed into a buffer the calling thread keeps between calls: a smaller call after a
    larger one (and the larger one again) must see only its own rows."""
    gen = torch.Generator().manual_seed(11)
    shapes = [(40, 1536, 33), (1, 8, 16), (17, 100, 40), (40, 1536, 33), (3, 64, 20)]
    for rows, k, n in shapes:
        x, weight_t = torch.randn(rows, k, generator=gen), torch.randn(k, n, generator=gen)
        got = panel_gemm.linear(x, panel_gemm.pack(weight_t), None, n)
        torch.testing.assert_close(
            got.double(), _reference(x, weight_t, None), rtol=1e-5, atol=1e-4
        )


def test_linear_takes_the_panels_up_to_max_exact_rows_only():
    torch.manual_seed(0)
    layer = Linear(64, 48, bias=True)
    torch.nn.init.normal_(layer.weight_t)
    torch.nn.init.normal_(layer.bias)
    layer.pack()
    layer.pack_panels()
    small, tall = torch.randn(Linear.MAX_EXACT_ROWS, 64), torch.randn(Linear.MAX_EXACT_ROWS + 1, 64)
    with torch.no_grad():
        assert torch.equal(layer(small), panel_gemm.linear(small, layer.panels, layer.bias, 48))
        # taller inputs stay on oneDNN's prepacked weight: spoil the panels, nothing changes
        expected = layer(tall)
        layer.panels = torch.zeros_like(layer.panels)
        assert torch.equal(layer(tall), expected)
        assert not torch.equal(
            layer(small), panel_gemm.linear(small, panel_gemm.pack(layer.weight_t), layer.bias, 48)
        )


def test_malformed_inputs_are_refused_naming_the_op_and_field():
    x, panels = torch.randn(2, 32), panel_gemm.pack(torch.randn(32, 40))
    with pytest.raises(RuntimeError, match=r"panel_linear: x has 31 columns, the panels 32 rows"):
        panel_gemm.linear(x[:, :31], panels, None, 40)
    with pytest.raises(RuntimeError, match=r"panel_linear: 3 panels cannot hold 49 columns"):
        panel_gemm.linear(x, panels, None, 49)
    with pytest.raises(RuntimeError, match=r"panel_linear: 3 panels cannot hold 32 columns"):
        panel_gemm.linear(x, panels, None, 32)
    with pytest.raises(
        RuntimeError, match=r"panel_linear: bias must be a contiguous float32 \[40\]"
    ):
        panel_gemm.linear(x, panels, torch.zeros(41), 40)
    with pytest.raises(RuntimeError, match=r"panel_linear: x must be a float32"):
        panel_gemm.linear(x.double(), panels, None, 40)
    with pytest.raises(RuntimeError, match=r"panel_linear: panels must be a contiguous float32"):
        panel_gemm.linear(x, panels.transpose(0, 1), None, 40)


def test_the_engine_packs_panels_unless_told_not_to(monkeypatch):
    ckpt = tiny_model(3, num_layers=2, num_heads=4, num_kv_heads=2)
    prompts, params = [[3, 1, 4, 1, 5], [9, 2, 6]], SamplingParams(max_tokens=8, ignore_eos=True)
    on = Engine(ckpt, EngineConfig(num_blocks=64))
    assert on.model.lm_head.panels is not None
    assert on.model.layers[1].mlp.down_proj.panels is not None
    off = Engine(ckpt, EngineConfig(num_blocks=64, panel_gemm=False))
    assert off.model.lm_head.panels is None
    # greedy tokens agree with oneDNN's on this peaked tiny model (no float near-tie in it)
    assert on.generate(prompts, params) == off.generate(prompts, params)
    monkeypatch.setenv(panel_gemm.ENV_SWITCH, "0")
    assert not panel_gemm.enabled(True, torch.device("cpu"), torch.float32)
    assert Engine(ckpt, EngineConfig(num_blocks=64)).model.lm_head.panels is None
    monkeypatch.delenv(panel_gemm.ENV_SWITCH)
    assert not panel_gemm.enabled(True, torch.device("cpu"), torch.bfloat16)
    assert panel_gemm.enabled(True, torch.device("cpu"), torch.float32)  # this AVX-512F host
