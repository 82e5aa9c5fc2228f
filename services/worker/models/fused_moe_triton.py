"""The experts of an MoE layer on CUDA: two Triton grouped GEMMs (vLLM's fused_moe design).

`align_block_size` sorts the (token, slot) pairs by expert and pads each expert's group to a
multiple of BLOCK_M, so every BLOCK_M-row tile of the sorted list belongs to one expert; the
kernel's program (tile, column block) multiplies its rows by that expert's weight matrix. The
layout is computed with device tensor ops only, in buffers whose sizes depend on the shapes
alone: expert counts by `scatter_add_` (torch.bincount reads its maximum back to the host on
CUDA), no `.item()`/`.tolist()`, no nonzero/unique/masked_select, no tensor built from a Python
list. So an MoE decode step stays capturable in a CUDA graph; tests/unit/worker/test_moe_no_host_sync.py
records the aten ops of the routing and grouping path and checks none of them syncs. Tiles
past the padded total exit at once.

Without CUDA the kernel runs under TRITON_INTERPRET=1 on CPU tensors (tests/unit/worker/test_fused_moe_triton.py),
like the attention kernels (services/worker/attention/triton_kernels.py, whose `dot`
precision rules this shares).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.attention.triton_kernels import check_device, dot, is_interpreted

BLOCK_M = 16


def expert_counts(key: torch.Tensor, size: int) -> torch.Tensor:
    """How many entries of `key` (int64 in [0, size)) hold each value, [size] int64: a scatter-add
    on the key's device, where torch.bincount would sync with the host to size its output."""
    return torch.zeros(size, dtype=torch.int64, device=key.device).scatter_add_(0, key, torch.ones_like(key))


def align_block_size(ids: torch.Tensor, num_experts: int,
                     block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] → (sorted_pairs [P], expert_of_tile [P // block_m], num_padded [1]).

    sorted_pairs lists the flat pair indices t * k + j grouped by expert (ascending; within an
    expert, in pair order), each group padded with the sentinel T * k to a multiple of block_m;
    P = T * k + E * (block_m - 1) rounded up to block_m bounds the padded total whatever the
    routing. Ids outside [0, E) (experts another rank holds) are left out."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    capacity = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    held = (flat >= 0) & (flat < num_experts)
    key = torch.where(held, flat, num_experts)  # not held: after every expert
    order = torch.argsort(key, stable=True)
    counts = expert_counts(key, num_experts + 1)
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    tile_ends = torch.cumsum(padded, 0)
    group_starts = tile_ends - padded  # where each expert's padded group starts
    first_of = torch.cumsum(counts, 0) - counts  # where each expert's pairs start in `order`
    sorted_key = key[order]
    rank_in_group = torch.arange(num_pairs, device=ids.device) - first_of[sorted_key]
    # Pairs not held go to a spare slot past the end, dropped below.
    starts = torch.nn.functional.pad(group_starts, (0, 1), value=capacity)  # a fill, not a host copy
    dest = torch.where(sorted_key < num_experts, starts[sorted_key] + rank_in_group, capacity)
    sorted_pairs = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    tile_starts = torch.arange(0, capacity, block_m, device=ids.device)
    expert_of_tile = torch.searchsorted(tile_ends, tile_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs[:capacity], expert_of_tile.to(torch.int32), tile_ends[-1:].to(torch.int32)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_pairs_ptr, expert_of_tile_ptr, num_padded_ptr,
    N, K, num_pairs,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    ROWS_PER_A: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """C[pair, n] = sum_k A[pair // ROWS_PER_A, k] * B[expert, n, k] (times the pair's routing
    weight with MUL_WEIGHT) for the BLOCK_M pairs of one tile and BLOCK_N columns."""
    tile = tl.program_id(0)
    col_block = tl.program_id(1)
    if tile * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < num_pairs
    expert = tl.load(expert_of_tile_ptr + tile).to(tl.int64)
    a_rows = pairs // ROWS_PER_A
    offs_n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                    mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
                    mask=(offs_n[None, :] < N) & (offs_k[:, None] < K), other=0.0)
        acc += dot(a, b.to(a.dtype), PRECISION, UPCAST)
    out = acc.to(c_ptr.dtype.element_ty)  # rounded as the torch path's GEMM output is, then weighted
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pairs, mask=valid, other=0.0)
        out = (out.to(tl.float32) * w.to(tl.float32)[:, None]).to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + pairs[:, None] * stride_cm + offs_n[None, :], out,
             mask=valid[:, None] & (offs_n[None, :] < N))


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weights: torch.Tensor,
                  layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rows_per_a: int,
                  mul_weight: bool) -> None:
    sorted_pairs, expert_of_tile, num_padded = layout
    n, k = b.shape[1], b.shape[2]
    block_n = 64 if n >= 64 else 32
    block_k = 64 if k >= 64 else 32
    grid = (expert_of_tile.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, c, weights, sorted_pairs, expert_of_tile, num_padded,
        n, k, c.shape[0],
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), c.stride(0),
        ROWS_PER_A=rows_per_a, MUL_WEIGHT=mul_weight,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        UPCAST=is_interpreted() and a.dtype == torch.bfloat16,
    )


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """Same contract as `moe.grouped_experts`: x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights and
    ids [T, k] → [T, H]; ids outside [0, E) contribute nothing."""
    check_device(x, w13, w2, weights, ids)
    num_tokens, top_k = ids.shape
    num_pairs = num_tokens * top_k
    intermediate = w13.shape[1] // 2
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    flat_weights = weights.reshape(-1).contiguous()
    layout = align_block_size(ids, w13.shape[0])
    gate_up = torch.empty(num_pairs, 2 * intermediate, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, flat_weights, layout, rows_per_a=top_k, mul_weight=False)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = (torch.nn.functional.silu(gate) * up).contiguous()
    down = torch.zeros(num_pairs, x.shape[1], dtype=x.dtype, device=x.device)  # pairs not held stay 0
    _grouped_gemm(hidden, w2, down, flat_weights, layout, rows_per_a=1, mul_weight=True)
    return sum_in_expert_order(down.view(num_tokens, top_k, -1), ids)


def sum_in_expert_order(down: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """down [T, k, H] (each pair's weighted expert output) → [T, H]: each token's k outputs summed
    in ascending expert order (HF's order; exact in fp32)."""
    by_expert = down.gather(1, torch.argsort(ids, dim=1, stable=True)[:, :, None].expand(-1, -1, down.shape[2]))
    out = torch.zeros_like(down[:, 0])
    for slot in range(ids.shape[1]):  # k is small (2-8): a loop over slots, not tokens
        out = out + by_expert[:, slot]
    return out
