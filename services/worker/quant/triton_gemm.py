"""A dequantizing GEMM on CUDA for GGUF's block formats: y = x @ W^T with W kept as the raw bytes
of a GGUF tensor (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), never expanded in memory.

`matmul(x [M, K], raw uint8 [N, row_bytes], qtype, N, K) -> [M, N]` in x's dtype. Program
(row tile, column tile) walks K in tiles of BLOCK_K weights: it loads x's tile, dequantizes W's
[BLOCK_N, BLOCK_K] tile in registers (each weight's block header, scale and quant bits gathered
from the row's bytes by its position, the arithmetic of ggml's dequantize_row_*) and accumulates
tl.dot of the two in fp32. Decoding reads the quantized bytes once per token, which is the point
of serving a 4-bit file: a Q4_K row is 4.5 bits a weight against fp16's 16.

Layouts (ggml's block structs; f16 values little-endian; j = the weight's index in its block):
- Q4_0 (32 weights, 18 bytes): d, qs[16]; w = d * (nibble - 8), nibble j%16 of qs, low for j < 16.
- Q4_1 (32, 20): d, m, qs[16]; w = d * nibble + m.
- Q8_0 (32, 34): d, qs[32] int8; w = d * qs[j].
- Q4_K (256, 144): d, dmin, scales[12] (eight 6-bit scale/min pairs), qs[128]; 64-weight groups
  g take qs[32g .. 32g+31], low nibbles for sub-block 2g, high for 2g+1; w = d*sc*q - dmin*m.
- Q5_K (256, 176): as Q4_K with qh[32] before qs: bit s of qh[j%32] is sub-block s's fifth bit.
- Q6_K (256, 210): ql[128], qh[64], scales[16] int8, d; 128-weight halves h, quarters t of 32:
  q = (ql[64h + 32(t%2) + l] >> 4(t//2) & 15) | (qh[32h + l] >> 2t & 3) << 4, minus 32;
  w = d * scales[8h + 2t + l//16] * q.

Imports triton: only CUDA paths import this module (the CPU kernels never do). Without CUDA it
runs under TRITON_INTERPRET=1 on CPU tensors (tests/unit/worker/test_quant_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.attention.triton_kernels import check_device, is_interpreted

__all__ = ["BLOCK_FORMATS", "matmul", "row_bytes"]

# GGML type id -> (weights per block, bytes per block); the ids are GGUF's (gguf.GGMLQuantizationType).
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14
BLOCK_FORMATS = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176),
                 Q6_K: (256, 210)}
_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of `k` weights in `qtype`."""
    block, size = _format(qtype)
    if k % block:
        raise ValueError(f"{_NAMES[qtype]} rows hold whole blocks of {block} weights, K = {k} is not a multiple")
    return k // block * size


def _format(qtype: int) -> tuple[int, int]:
    qtype = int(qtype)
    if qtype not in BLOCK_FORMATS:
        raise ValueError(f"GGML type {qtype} has no dequantizing GEMM (have {', '.join(_NAMES.values())})")
    return BLOCK_FORMATS[qtype]


@triton.jit
def _byte(row_ptr, offs, mask):
    """The bytes at `offs` of each row (as int32)."""
    return tl.load(row_ptr + offs, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(row_ptr, offs, mask):
    """The little-endian f16 at `offs` of each row, as fp32."""
    lo = tl.load(row_ptr + offs, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(row_ptr + offs + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_scale_min(row_ptr, s, mask):
    """The 6-bit scale and min of sub-block s (0..7) of a Q4_K / Q5_K block, from scales[12] at
    offset 4 of `row_ptr` (ggml's get_scale_min_k4)."""
    low = s < 4
    a = _byte(row_ptr, 4 + s, mask)                       # scales[s]
    b = _byte(row_ptr, 4 + s + 4, mask & low)             # scales[s + 4], s < 4
    c = _byte(row_ptr, 4 + tl.where(low, s, s + 4), mask)  # scales[s + 4], s >= 4 (a again below 4)
    e = _byte(row_ptr, 4 + tl.where(low, s, s - 4), mask)  # scales[s - 4], s >= 4
    sc = tl.where(low, a & 63, (c & 0xF) | ((e >> 6) << 4))
    mn = tl.where(low, b & 63, (c >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _dequant_tile(w_ptr, offs_n, offs_k, mask, stride_n, QTYPE: tl.constexpr, QK: tl.constexpr,
                  BLOCK_BYTES: tl.constexpr):
    """W[offs_n, offs_k] as fp32 [BLOCK_N, BLOCK_K], dequantized from the raw rows."""
    block = offs_k[None, :] // QK
    j = offs_k[None, :] % QK
    base = w_ptr + offs_n[:, None].to(tl.int64) * stride_n + block * BLOCK_BYTES
    if QTYPE == 2:  # Q4_0
        d = _f16(base, 0, mask)
        q = (_byte(base, 2 + j % 16, mask) >> ((j // 16) * 4)) & 0xF
        w = d * (q - 8).to(tl.float32)
    elif QTYPE == 3:  # Q4_1
        d = _f16(base, 0, mask)
        m = _f16(base, 2, mask)
        q = (_byte(base, 4 + j % 16, mask) >> ((j // 16) * 4)) & 0xF
        w = d * q.to(tl.float32) + m
    elif QTYPE == 8:  # Q8_0
        d = _f16(base, 0, mask)
        q = tl.load(base + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True)
        w = d * q.to(tl.float32)
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K
        d = _f16(base, 0, mask)
        dmin = _f16(base, 2, mask)
        s = j // 32
        sc, mn = _k_scale_min(base, s, mask)
        if QTYPE == 12:
            q = (_byte(base, 16 + (j // 64) * 32 + j % 32, mask) >> ((s % 2) * 4)) & 0xF
        else:  # qs follows qh[32]
            q = (_byte(base, 48 + (j // 64) * 32 + j % 32, mask) >> ((s % 2) * 4)) & 0xF
            q = q | (((_byte(base, 16 + j % 32, mask) >> s) & 1) << 4)
        w = d * sc * q.to(tl.float32) - dmin * mn
    else:  # Q6_K
        h = j // 128
        t = (j % 128) // 32
        lane = j % 32
        low = (_byte(base, 64 * h + 32 * (t % 2) + lane, mask) >> ((t // 2) * 4)) & 0xF
        high = (_byte(base, 128 + 32 * h + lane, mask) >> (2 * t)) & 3
        q = (low | (high << 4)) - 32
        scale = tl.load(base + 192 + 8 * h + 2 * t + lane // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
        w = _f16(base, 208, mask) * scale.to(tl.float32) * q.to(tl.float32)
    return w


@triton.jit
def _gguf_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      QTYPE: tl.constexpr, QK: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kt = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + offs_kt
        x_mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)
        w_mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
        w = _dequant_tile(w_ptr, offs_n, offs_k, w_mask, stride_wn, QTYPE, QK, BLOCK_BYTES)
        w = w.to(x.dtype)  # the weights at the activations' precision, as a dequantize-then-matmul has them
        if UPCAST_DOT:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=y_mask)


def matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, n: int, k: int, block_m: int | None = None,
           block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """x [M, K] (f16, bf16 or f32) @ W^T, W [N, K] given as GGUF's raw bytes [N, row_bytes]
    (uint8, rows contiguous); returns [M, N] in x's dtype. fp32 products are exact fp32 (no
    TF32), so an fp32 x gets fp32's accuracy."""
    qk, block_bytes = _format(qtype)
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {list(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be f16, bf16 or f32, got {x.dtype}")
    if raw.dtype != torch.uint8 or list(raw.shape) != [n, row_bytes(qtype, k)] or raw.stride(1) != 1:
        raise ValueError(f"raw must be uint8 [{n}, {row_bytes(qtype, k)}] with contiguous rows, got "
                         f"{raw.dtype} {list(raw.shape)}")
    if qk % block_k and block_k % qk:
        raise ValueError(f"block_k {block_k} and the {qk}-weight blocks must divide one another")
    check_device(x, raw)
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    # tl.dot wants at least 16 rows; a decode step's few rows are padded by the mask.
    block_m = block_m or max(16, min(64, triton.next_power_of_2(m)))
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _gguf_gemm_kernel[grid](x, raw, y, m, n, k, x.stride(0), raw.stride(0), y.stride(0),
                            QTYPE=int(qtype), QK=qk, BLOCK_BYTES=block_bytes, BLOCK_M=block_m,
                            BLOCK_N=block_n, BLOCK_K=block_k,
                            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                            # Triton's interpreter computes a bf16 tl.dot wrongly; fp32 operands holding the
                            # same bf16 values give the same exact products.
                            UPCAST_DOT=is_interpreted() and x.dtype == torch.bfloat16)
    return y
