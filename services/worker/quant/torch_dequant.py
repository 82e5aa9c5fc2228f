"""Dequantize GGUF blocks with torch ops: where no C kernel runs (the GPU fallback, tests).

Each function mirrors gguf-py's numpy `dequantize_blocks` for its type operation by operation
(fp16 scales widened to fp32, the same multiplies and adds in the same order), so the result is
bit-identical to `gguf.quants.dequantize` (tests/unit/worker/test_gguf_model.py checks it).
Input: raw blocks, uint8 [rows, row_bytes] on any device; output: fp32 [rows, in_features].
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from services.worker.quant import block_size, type_size

QK_K = 256


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[n, 2] bytes → [n, 1] fp32 from their fp16 value."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """Low then high 4 bits of [n, groups * width] bytes → [n, groups, 2 * width]."""
    qs = qs.reshape(qs.shape[0], groups, 1, width)
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=qs.device).reshape(1, 1, 2, 1)
    return ((qs >> shifts) & 0x0F).reshape(qs.shape[0], groups, 2 * width)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:], 1, 16).reshape(b.shape[0], -1).to(torch.int8) - 8
    return d * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:], 1, 16).reshape(b.shape[0], -1).float()
    return d * q + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins packed in Q4_K/Q5_K's 12 bytes."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (d * sc.float()).reshape(n, -1, 1)
    dm = (dmin * mn.float()).reshape(n, -1, 1)
    q = _nibbles(b[:, 16:], 4, 32).reshape(n, -1, 32).float()
    return (d * q - dm).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    qh, qs = b[:, 16:16 + QK_K // 8], b[:, 16 + QK_K // 8:]
    d = (d * sc.float()).reshape(n, -1, 1)
    dm = (dmin * mn.float()).reshape(n, -1, 1)
    ql = _nibbles(qs, 4, 32).reshape(n, -1, 32)
    bits = torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 1, 8, 1)
    high = ((qh.reshape(n, -1, 1, 32) >> bits) & 0x01).reshape(n, -1, 32)
    q = (ql | (high << 4)).float()
    return (d * q - dm).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh = b[:, :QK_K // 2], b[:, QK_K // 2:QK_K // 2 + QK_K // 4]
    scales, d = b[:, QK_K // 2 + QK_K // 4:-2], b[:, -2:]
    scales = scales.contiguous().view(torch.int8).float()
    d = (_f16(d) * scales).reshape(n, QK_K // 16, 1)
    low = _nibbles(ql, 2, 64).reshape(n, -1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    high = ((qh.reshape(n, -1, 1, 32) >> shifts) & 0x03).reshape(n, -1, 32)
    q = (low | (high << 4)).to(torch.int8) - 32
    q = q.reshape(n, QK_K // 16, -1).float()
    return (d * q).reshape(n, QK_K)


_BLOCK_DEQUANT = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q8_0: _q8_0, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}


def dequantize(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """uint8 [rows, row_bytes] blocks of `qtype` → fp32 [rows, row_bytes / type_size * block_size]."""
    qtype = Q(qtype)
    if qtype not in _BLOCK_DEQUANT:
        raise NotImplementedError(f"no torch dequantization for GGUF type {qtype.name}")
    rows, nbytes = raw.shape
    in_features = nbytes // type_size(qtype) * block_size(qtype)
    return _BLOCK_DEQUANT[qtype](raw.reshape(-1, type_size(qtype))).reshape(rows, in_features)
