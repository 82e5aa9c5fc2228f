"""Our fp32 AVX-512 GEMM (services/worker/cpu/gemm.c) against exact (float64) products: row counts
around its 12-row tiles and 96-row units (the tails have copies of their own), inner sizes that
are not multiples of the vector width, with and without bias, strided and 3-d inputs, 1 and 2
threads; and the linear layers that use it.

The bound: each output is one fp32 sum of K products with fused multiply-adds, so its error is
at most g(K) * sum_k |x_k w_k| (Higham ch. 3, g(n) = n u / (1 - n u), u = 2^-24), plus one
rounding for the bias.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.cpu.gemm import BLOCK, PanelGemm
from services.worker.models.cpu_linear import PackedLinear

gemm = PanelGemm.load()
pytestmark = pytest.mark.skipif(gemm is None, reason="this CPU has no AVX-512 (the layers keep oneDNN's GEMMs)")

U = 2.0 ** -24


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    x64, w64 = x.double(), w.double()
    exact = x64 @ w64.t() + (0 if bias is None else bias.double())
    k = w.shape[1]
    g = k * U / (1 - k * U)
    bound = g * (x64.abs() @ w64.abs().t()) + 2 * U * exact.abs()
    assert bool(((got.double() - exact).abs() <= bound).all()), float((got.double() - exact).abs().max())


@pytest.mark.parametrize("rows", [1, 11, 12, 13, 64, 97, 300])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_matches_exact_products(rows: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    n, k = 3 * BLOCK, 77
    w, x, bias = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    packed = gemm.pack(w)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check(gemm.matmul(x, packed, None), x, w, None)
        _check(gemm.matmul(x, packed, bias), x, w, bias)
    finally:
        torch.set_num_threads(previous)


def test_packed_linear_takes_it_for_fp32_and_matches_f_linear() -> None:
    """fp32 layers whose output size is a multiple of the block use it (any input shape), the
    others and bf16 keep oneDNN; results within the bound of F.linear's exact value."""
    gen = torch.Generator().manual_seed(0)
    w, bias = torch.randn(2 * BLOCK, 40, generator=gen), torch.randn(2 * BLOCK, generator=gen)
    layer = PackedLinear(w, bias)
    assert layer.gemm is not None
    x = torch.randn(3, 5, 80, generator=gen)[..., ::2]  # 3-d, strided rows
    got = layer(x)
    assert got.shape == (3, 5, 2 * BLOCK)
    _check(got.reshape(-1, 2 * BLOCK), x.reshape(-1, 40), w, bias)
    assert PackedLinear(torch.randn(BLOCK + 8, 40), None).gemm is None
    assert PackedLinear(w.bfloat16(), None).gemm is None
    empty = layer(torch.empty(0, 40))
    assert empty.shape == (0, 2 * BLOCK)
    assert torch.allclose(F.linear(x, w, bias), got, rtol=1e-5, atol=1e-5)
