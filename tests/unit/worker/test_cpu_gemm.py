"""Our AVX-512 GEMM (services/worker/cpu/gemm.c) against exact (float64) products, fp32 and bf16,
at each instruction-set level with code of its own that this CPU runs: row counts around its
12-row tiles and 96-row units (the tails have copies of their own), inner sizes that are not
multiples of the vector width, with and without bias, strided and 3-d inputs, 1 and 2 threads;
and the linear layers that use it.

The bound: each output is one fp32 sum of K products with fused multiply-adds (bf16: products of
bf16 values, exact in fp32, summed in fp32), so its error is at most g(K) * sum_k |x_k w_k|
(Higham ch. 3, g(n) = n u / (1 - n u), u = 2^-24), plus one rounding for the bias; a bf16 output
adds its rounding to bf16, half a step (2^-9 of the value).
"""

from __future__ import annotations

import pytest
import torch
from support.isa_levels import levels_here

from services.worker.cpu.gemm import BLOCK, HIGHEST_ISA, PanelGemm
from services.worker.models.cpu_linear import PackedLinear

LEVELS = [level for level in levels_here(HIGHEST_ISA) if PanelGemm.load(level) is not None]
pytestmark = pytest.mark.skipif(not LEVELS, reason="this CPU has no AVX-512 (the layers keep oneDNN's GEMMs)")

U = 2.0 ** -24


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    x64, w64 = x.double(), w.double()
    exact = x64 @ w64.t() + (0 if bias is None else bias.double())
    k = w.shape[1]
    g = k * U / (1 - k * U)
    bound = g * (x64.abs() @ w64.abs().t()) + 2 * U * exact.abs()
    if got.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * exact.abs()
    assert bool(((got.double() - exact).abs() <= bound).all()), float((got.double() - exact).abs().max())


def _check_with_and_without_bias(gemm: PanelGemm, n: int, k: int, rows: int, dtype: torch.dtype,
                                 threads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random [rows, k] x [n, k]^T (+ bias) at `threads` threads, checked against the exact
    products; returns the packed weight, the inputs and the bias for further checks."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x, bias = torch.randn(rows, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
    packed = gemm.pack(w)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check(gemm.matmul(x, packed, None), x, w, None)
        _check(gemm.matmul(x, packed, bias), x, w, bias)
    finally:
        torch.set_num_threads(previous)
    return packed, x, bias


LEVEL_DTYPES = [(level, dtype) for level in LEVELS for dtype in PanelGemm.load(level).dtypes]


@pytest.mark.parametrize(("level", "dtype"), LEVEL_DTYPES)
@pytest.mark.parametrize("rows", [1, 11, 12, 13, 64, 97, 300])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_matches_exact_products(level: str, dtype: torch.dtype, rows: int, threads: int) -> None:
    _check_with_and_without_bias(PanelGemm.load(level), 3 * BLOCK, 78, rows, dtype, threads)


def test_packed_linear_takes_it_where_it_applies() -> None:
    """Layers whose output size is a multiple of the block use it (any input shape) in the dtypes
    this CPU's build has; odd sizes keep oneDNN; results within the bound of the exact value."""
    gemm = PanelGemm.load()
    gen = torch.Generator().manual_seed(0)
    for dtype in gemm.dtypes:
        w, bias = torch.randn(2 * BLOCK, 40, generator=gen).to(dtype), torch.randn(2 * BLOCK, generator=gen).to(dtype)
        layer = PackedLinear(w, bias)
        assert layer.gemm is gemm
        x = torch.randn(3, 5, 80, generator=gen).to(dtype)[..., ::2]  # 3-d, strided rows
        got = layer(x)
        assert got.shape == (3, 5, 2 * BLOCK) and got.dtype == dtype
        _check(got.reshape(-1, 2 * BLOCK), x.reshape(-1, 40), w, bias)
        assert layer(torch.empty(0, 40, dtype=dtype)).shape == (0, 2 * BLOCK)
        assert PackedLinear(torch.randn(BLOCK + 8, 40).to(dtype), None).gemm is None
    assert PackedLinear(torch.randn(2 * BLOCK, 41).bfloat16(), None).gemm is None  # bf16 needs pairs of k


def test_bf16_stays_on_onednn_where_the_cpu_has_amx_and_this_build_not() -> None:
    """oneDNN's bf16 GEMMs use AMX tiles where the CPU has them; ours are taken there only when
    built with the tiles too."""
    from services.worker.cpu.gemm import keeps_onednn_for_bf16

    assert keeps_onednn_for_bf16({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
    assert not keeps_onednn_for_bf16({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, has_amx_tiles=True)
    assert not keeps_onednn_for_bf16({"avx512f", "avx512_bf16"})


AMX_LEVELS = [level for level in LEVELS if PanelGemm.load(level).amx_bf16]


@pytest.mark.skipif(not AMX_LEVELS, reason="this CPU has no AMX tiles for bf16 (or they are not granted)")
@pytest.mark.parametrize("rows", [16, 17, 31, 32, 33, 95, 96, 97, 130])
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_bf16_tiles_match_exact_products(rows: int, threads: int) -> None:
    """From 16 rows, bf16 with K a multiple of 32 runs on the AMX tiles: pairs of row groups, one
    group alone, the vdpbf16ps tail, chunk boundaries (96 rows), with and without bias."""
    gemm = PanelGemm.load(AMX_LEVELS[0])
    packed, x, bias = _check_with_and_without_bias(gemm, 3 * BLOCK, 96, rows, torch.bfloat16, threads)
    # each row as it would come out alone or among others: the path depends on the row count only
    assert torch.equal(gemm.matmul(x, packed, bias)[:16], gemm.matmul(x[:16], packed, bias))
