"""The GGUF quantized-block kernels (services/worker/quant/quant_gemm.c) at each instruction-set
level this CPU runs that has code of its own (AVX-512, AVX2, and the plain x86-64 build's scalar
code): dequantization bit-exact against the gguf package's numpy reference for every type, and
products against exact (float64) products with the dequantized weights.

Blocks: Q4_0, Q4_1 and Q8_0 from gguf.quants.quantize of random weights; the K-quants, which the
gguf package cannot quantize, as random bytes with finite fp16 scales (every bit pattern of the
rest is a valid block).

The bound: every path multiplies x by the exact dequantized weights in fp32, so each output is an
fp32 dot product of K terms, with at most a few more roundings from the per-block sums (Higham ch.
3: error <= g(K + 8) * sum_k |x_k w_k|, g(n) = n u / (1 - n u), u = 2^-24), plus one rounding for the
bias; a bf16 output adds its rounding to bf16 (2^-9 of the value); bf16 inputs are exact in fp32.

The integer path (int8_dot, Q4_0, Q4_1, Q8_0 with AVX2 or better) replaces each 32-value block
of x by dx * qx, qx an integer held as two int8 parts (quant_q8.h), dx = max|x| / (127 * 254): each
value moves by at most dx / 2 (and a few roundings of x / dx), and it multiplies d * q, whose
size is at most |w| + |offset| (offset: Q4_0's -8 d, Q4_1's m: the value of a block whose quants
are all 0). So that path's bound adds
sum_k (|w_k| + |offset_k|) * 0.501 dx_k, and its fp32 sums are bounded with |x| + dx in place of |x|.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from services.worker.cpu import cbuild
from services.worker.quant import row_bytes
from services.worker.quant.kernels import HIGHEST_ISA, QuantGemm

U = 2.0 ** -24
TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0,
         GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K]
QUANTIZABLE = {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0}
# Byte offsets of each K-quant block's fp16 scales (d, and dmin where there is one).
K_SCALE_OFFSETS = {GGMLQuantizationType.Q4_K: (0, 2), GGMLQuantizationType.Q5_K: (0, 2),
                   GGMLQuantizationType.Q6_K: (208,)}
# The levels with code of their own in quant_gemm.c (AMX tiles, VNNI's vpdpbusd, AVX-512, AVX2); x86-64
# runs the scalar fallbacks.
DISTINCT = ("amx_int8", "avx512_vnni", "avx512", "avx2", "x86-64")
LEVELS = [level for level in cbuild.isa_levels(highest=HIGHEST_ISA) if level in DISTINCT] or [None]
LEVELS = [level for level in LEVELS if QuantGemm.load(level) is not None]
pytestmark = pytest.mark.skipif(not LEVELS, reason="the quantized kernels cannot be built here (no C compiler)")


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, row bytes] of valid blocks of `qtype`."""
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        weights = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.1, 2, (rows, 1))
        return quants.quantize(weights.astype(np.float32), qtype)
    values, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    for offset in K_SCALE_OFFSETS[qtype]:  # finite scales of either sign, around 1e-3 .. 1e-1
        scales = (rng.uniform(1e-3, 1e-1, blocks.shape[:2]) * rng.choice([-1, 1], blocks.shape[:2]))
        blocks[:, :, offset:offset + 2] = scales.astype(np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


# The bytes of each 32-value type's block that hold its quants (zeroed: the block's offset).
QUANT_BYTES = {GGMLQuantizationType.Q4_0: slice(2, 18), GGMLQuantizationType.Q4_1: slice(4, 20),
               GGMLQuantizationType.Q8_0: slice(2, 34)}


def offsets(raw: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Each weight's offset: the dequantized value of its block with all quants 0."""
    blocks = raw.reshape(raw.shape[0], -1, GGML_QUANT_SIZES[qtype][1]).copy()
    blocks[:, :, QUANT_BYTES[qtype]] = 0
    return torch.from_numpy(quants.dequantize(blocks.reshape(raw.shape), qtype))


def _bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, exact: torch.Tensor,
           offset: torch.Tensor | None) -> torch.Tensor:
    k = w.shape[1] + 8
    g = k * U / (1 - k * U)
    x64, w64 = x.double().abs(), w.double().abs()
    if offset is not None:  # the integer path: x off by up to dx / 2 per value
        dx = (x64.view(x.shape[0], -1, 32).amax(-1, keepdim=True) / (127 * 254)).expand(-1, -1, 32).reshape(x.shape)
        w64 = w64 + offset.double().abs()
        return 0.501 * dx @ w64.t() + g * ((x64 + dx) @ w64.t()) + (0 if bias is None else 2 * U * exact.abs())
    return g * (x64 @ w64.t()) + (0 if bias is None else 2 * U * exact.abs())


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
           offset: torch.Tensor | None = None) -> None:
    exact = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    bound = _bound(x, w, bias, exact, offset)
    if got.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * exact.abs()
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_bit_exact(level: str | None, qtype: GGMLQuantizationType) -> None:
    gemm = QuantGemm.load(level)
    assert gemm.supports(qtype)
    rows, cols = 7, 512
    raw = random_blocks(qtype, rows, cols, seed=int(qtype))
    expected = quants.dequantize(raw, qtype)
    prepared = gemm.prepare(torch.from_numpy(raw), qtype, cols)
    got = gemm.dequantize(prepared, qtype, rows, cols)
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert np.array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))
    ids = torch.tensor([6, 0, 3, 3])
    looked_up = gemm.dequantize(prepared, qtype, rows, cols, rows=ids)
    assert np.array_equal(looked_up.numpy().view(np.uint32), expected[ids.numpy()].view(np.uint32))
    with pytest.raises(IndexError):
        gemm.dequantize(prepared, qtype, rows, cols, rows=torch.tensor([rows]))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 17, 130])
def test_matmul_matches_exact_products(level: str | None, qtype: GGMLQuantizationType, rows: int) -> None:
    gemm = QuantGemm.load(level)
    n, k = 37, 512  # odd output count: partial tiles and thread shares
    raw = random_blocks(qtype, n, k, seed=rows)
    w = torch.from_numpy(quants.dequantize(raw, qtype))
    prepared = gemm.prepare(torch.from_numpy(raw), qtype, k)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            _check(gemm.matmul(x, prepared, qtype, n, k, int8_dot=False), x, w, None)
            _check(gemm.matmul(x, prepared, qtype, n, k, bias=bias, int8_dot=False), x, w, bias)
            xb = x.bfloat16()
            got = gemm.matmul(xb, prepared, qtype, n, k, bias=bias.bfloat16(), int8_dot=False)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
            _check(got, xb.float(), w, bias.bfloat16().float())
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("qtype", sorted(QUANT_BYTES))
@pytest.mark.parametrize("rows", [1, 3, 5, 7, 8, 17, 130])
def test_int8_path_within_its_bound(level: str | None, qtype: GGMLQuantizationType, rows: int) -> None:
    """Calls with int8 activations, where the build has that path (else the fp32 path, within the
    tighter bound): packed groups of 16 weight rows (37 outputs: a partial group), 4 rows of x at
    a time and a tail; from 16 rows on AMX tiles where the build has them."""
    gemm = QuantGemm.load(level)
    n, k = 37, 576
    raw = random_blocks(qtype, n, k, seed=rows)
    w, offset = torch.from_numpy(quants.dequantize(raw, qtype)), offsets(raw, qtype)
    prepared = gemm.prepare(torch.from_numpy(raw), qtype, k)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=gen) * 3, torch.randn(n, generator=gen)
    x[0, :32] = 0  # a block of zeros: dx = 0
    used = offset if gemm.has_int8_dot(qtype) else None
    _check(gemm.matmul(x, prepared, qtype, n, k, bias=bias, int8_dot=True), x, w, bias, used)
    xb = x.bfloat16()
    _check(gemm.matmul(xb, prepared, qtype, n, k, int8_dot=True), xb.float(), w, None, used)
    if gemm.has_int8_dot(qtype):  # the bound is not vacuous: the fp32 path is much closer
        exact = x.double() @ w.double().t() + bias.double()
        fp32 = gemm.matmul(x, prepared, qtype, n, k, bias=bias, int8_dot=False)
        assert bool(((fp32.double() - exact).abs() <= _bound(x, w, bias, exact, None)).all())


AMX = QuantGemm.load("amx_int8") if "amx_int8" in LEVELS else None


@pytest.mark.skipif(AMX is None or not AMX.uses_amx(), reason="no AMX tiles here (amx_int8, and Linux's permission)")
@pytest.mark.parametrize("qtype", sorted(QUANT_BYTES))
@pytest.mark.parametrize("rows", [16, 17, 37, 130])
def test_amx_tiles_give_the_vnni_kernels_bits(qtype: GGMLQuantizationType, rows: int) -> None:
    """From 16 rows the amx_int8 build multiplies on AMX tiles (quant_amx.h): the same integer block
    sums and fp32 operations as the packed VNNI groups, so the same bits, with a bias, in bf16, and
    with rows past a chunk of 16 and outputs past a group of 16 (37 weight rows)."""
    vnni = QuantGemm.load("avx512_vnni")
    n, k = 37, 576
    raw = random_blocks(qtype, n, k, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=gen) * 3, torch.randn(n, generator=gen)
    x[1, 32:64] = 0  # a block of zeros: dx = 0
    prepared = AMX.prepare(torch.from_numpy(raw), qtype, k)
    for xi, b in ((x, bias), (x.bfloat16(), None)):
        got = AMX.matmul(xi, prepared, qtype, n, k, bias=b, int8_dot=True)
        assert torch.equal(got, vnni.matmul(xi, prepared, qtype, n, k, bias=b, int8_dot=True))
    w, offset = torch.from_numpy(quants.dequantize(raw, qtype)), offsets(raw, qtype)
    _check(AMX.matmul(x, prepared, qtype, n, k, bias=bias, int8_dot=True), x, w, bias, offset)


def test_prepare_checks_the_row_size_and_empty_inputs_work() -> None:
    gemm = QuantGemm.load(LEVELS[0])
    qtype = GGMLQuantizationType.Q8_0
    raw = torch.from_numpy(random_blocks(qtype, 4, 64, seed=0))
    with pytest.raises(ValueError):
        gemm.prepare(raw, qtype, 96)
    with pytest.raises(ValueError):
        row_bytes(GGMLQuantizationType.Q4_K, 576)  # not a multiple of the 256-value super-block
    prepared = gemm.prepare(raw, qtype, 64)
    assert gemm.matmul(torch.empty(0, 64), prepared, qtype, 4, 64).shape == (0, 4)
    assert gemm.dequantize(prepared, qtype, 4, 64, rows=torch.empty(0, dtype=torch.int64)).shape == (0, 64)
    assert not gemm.supports(int(GGMLQuantizationType.Q2_K))
