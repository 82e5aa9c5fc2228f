"""The adapters' products on CUDA as Punica's BGMV: each token reads only its own slot's A and B
(the dense masked GEMMs of apply.py read every slot's), in two kernels over the same slot table.

- shrink: program (token, part) computes u[t, part, :rank] = A[part, slot_t] @ x[t] (skipped for a
  base-only token, slot -1), walking the input in BLOCK_K tiles;
- expand: program (token, column tile) adds B[c, part(c), slot_t] @ u[t, part(c)] to y[t, c] for
  the tile's columns, each column reading the rank columns of its own fused part.

The tables are apply.GroupTable's: A [parts * slots * rank, in] part-major, B [out, parts * slots
* rank] block-diagonal over the parts. Accumulation in fp32. Imports triton: only CUDA paths import
this module; without CUDA it runs under TRITON_INTERPRET=1 on CPU tensors
(tests/unit/worker/test_lora_triton.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.attention.triton_kernels import check_device

BLOCK_K = 64
BLOCK_N = 64


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, u_ptr, K, stride_x, stride_a, num_slots,
                   RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    part = tl.program_id(1)
    num_parts = tl.num_programs(1)
    slot = tl.load(slots_ptr + t)
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:
        rows = (part * num_slots + slot) * RANK + r
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + t * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
            av = tl.load(a_ptr + rows[:, None] * stride_a + k[None, :], mask=(r[:, None] < RANK) & (k[None, :] < K),
                         other=0.0).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(u_ptr + (t * num_parts + part) * RANK + r, acc, mask=r < RANK)


@triton.jit
def _expand_kernel(y_ptr, u_ptr, b_ptr, slots_ptr, part_starts_ptr, N, stride_y, stride_b, num_slots, num_parts,
                   RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        part = tl.zeros((BLOCK_N,), dtype=tl.int32)
        for p in range(1, num_parts):  # the fused part each column belongs to
            part += (c >= tl.load(part_starts_ptr + p)).to(tl.int32)
        r = tl.arange(0, BLOCK_R)
        cols = (part[:, None] * num_slots + slot) * RANK + r[None, :]
        valid = (c[:, None] < N) & (r[None, :] < RANK)
        bv = tl.load(b_ptr + c[:, None] * stride_b + cols, mask=valid, other=0.0).to(tl.float32)
        uv = tl.load(u_ptr + (t * num_parts + part[:, None]) * RANK + r[None, :], mask=valid, other=0.0)
        delta = tl.sum(bv * uv, axis=1)
        y = tl.load(y_ptr + t * stride_y + c, mask=c < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * stride_y + c, (y + delta).to(y_ptr.dtype.element_ty), mask=c < N)


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
             columns: list[tuple[int, int]], num_slots: int, rank: int) -> torch.Tensor:
    """y[t, part columns] += B_part[slot_t] @ (A_part[slot_t] @ x[t]) in place (slot -1: untouched).
    a: [parts * num_slots * rank, in], b: [out, parts * num_slots * rank] (one layer's tables);
    token_slots: int32 [T] on y's device."""
    check_device(y, x, a, b, token_slots)
    if y.stride(1) != 1 or x.stride(1) != 1 or a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("add_lora needs row-major y, x, a and b")
    num_tokens, num_parts = x.shape[0], len(columns)
    if num_tokens == 0:
        return y
    block_r = triton.next_power_of_2(rank)
    u = torch.empty(num_tokens, num_parts, rank, dtype=torch.float32, device=x.device)
    _shrink_kernel[(num_tokens, num_parts)](x, a, token_slots, u, x.shape[1], x.stride(0), a.stride(0), num_slots,
                                            RANK=rank, BLOCK_R=block_r, BLOCK_K=BLOCK_K)
    part_starts = torch.tensor([start for start, _ in columns], dtype=torch.int32, device=x.device)
    _expand_kernel[(num_tokens, triton.cdiv(y.shape[1], BLOCK_N))](
        y, u, b, token_slots, part_starts, y.shape[1], y.stride(0), b.stride(0), num_slots, num_parts,
        RANK=rank, BLOCK_R=block_r, BLOCK_N=BLOCK_N)
    return y
