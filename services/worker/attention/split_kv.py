"""Split-KV ("flash-decoding") attention for decode-only steps: long contexts at small batch.

The varlen kernel (triton_kernels.py) runs one program per (query block, KV head): a decode
step of a few requests is a few dozen programs, each walking its request's whole context
alone, and most of the GPU idles. Here each (request, KV head) pair's keys are cut into
`num_splits` partitions of whole TILE_N tiles, one program each (grid: requests, KV heads,
splits); every program writes its partition's normalised output with its running max and
sum (log2 domain), and a second kernel (grid: tokens, heads) combines a head's partitions:

    out = sum_s w_s * o_s / sum_s w_s,   w_s = l_s * 2^(m_s - max_s m_s)

A partition past its request's context (a short request next to a long one) has l_s = 0 and
weighs nothing. The partition length is computed in the kernel from the context length, so
the grid depends only on the shapes and the number of splits: a CUDA graph can capture it.

`num_splits_for` is the rule: split only a decode-only step whose plain grid would leave the
GPU's multiprocessors idle, whose longest context is long enough to share out, and never
into partitions shorter than MIN_KEYS_PER_SPLIT keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.attention.triton_kernels import (
    check_device,
    compile_kernel,
    default_block_m,
    dot,
    is_interpreted,
)

# Contexts shorter than this decode fast enough in one program per (request, KV head).
MIN_SPLIT_CONTEXT = 1024
# Each partition keeps at least this many keys (its fixed costs amortised).
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 16


def num_splits_for(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """Partitions per (request, KV head) for a decode-only step whose plain kernel would run
    `num_programs` programs over contexts of up to `max_seq_len` keys on `num_sms`
    multiprocessors; 1: the plain kernel."""
    if max_seq_len < MIN_SPLIT_CONTEXT or num_programs >= num_sms:
        return 1
    to_fill = -(-num_sms // max(num_programs, 1))  # enough programs to cover every multiprocessor once
    return max(1, min(to_fill, max_seq_len // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


def multiprocessors(device: torch.device) -> int:
    """The device's multiprocessor count (an H100's 132 where there is no GPU: the rule stays testable)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


@triton.jit
def _split_kv_kernel(
    part_out_ptr, part_ml_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_table_ptr, query_start_loc_ptr, context_lens_ptr,
    scale_log2, num_heads,
    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, DIM_PAD: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """Partition `split` of request `req`'s keys for the query heads of `kv_head`: its one query
    token (position context_len) sees every key 0..context_len."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) == token:
        return  # no query token (not a decode step's request)
    num_keys = tl.load(context_lens_ptr + req) + 1
    per_split = tl.cdiv(tl.cdiv(num_keys, NUM_SPLITS), TILE_N) * TILE_N
    start = split * per_split
    end = tl.minimum(start + per_split, num_keys)

    offs_m = tl.arange(0, BLOCK_M)  # row r: query head kv_head * QUERIES_PER_KV + r
    row_valid = offs_m < QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + offs_m
    offs_d = tl.arange(0, DIM_PAD)
    d_valid = offs_d < HEAD_DIM
    q = tl.load(q_ptr + token.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for tile in range(start, end, TILE_N):
        key_pos = tile + offs_n
        key_valid = key_pos < end
        blk = tl.load(bt_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (key_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache_ptr + kv_off[None, :] + offs_d[:, None],
                    mask=key_valid[None, :] & d_valid[:, None], other=0.0)  # [DIM_PAD, TILE_N]
        s = dot(q, k.to(q.dtype), PRECISION, UPCAST) * scale_log2
        s = tl.where(key_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.math.exp2(s - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :],
                    mask=key_valid[:, None] & d_valid[None, :], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new

    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    part = (token.to(tl.int64) * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
    tl.store(part_out_ptr + part[:, None] * DIM_PAD + offs_d[None, :], out, mask=row_valid[:, None])
    tl.store(part_ml_ptr + part * 2, m_i, mask=row_valid)
    tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_valid)


@triton.jit
def _combine_kernel(
    out_ptr, part_out_ptr, part_ml_ptr, query_start_loc_ptr, num_heads,
    stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
):
    """out[token, head] from the head's NUM_SPLITS partitions."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) == token:
        return
    offs_s = tl.arange(0, SPLITS_PAD)
    s_valid = offs_s < NUM_SPLITS
    part = (token.to(tl.int64) * num_heads + head) * NUM_SPLITS + offs_s
    m = tl.load(part_ml_ptr + part * 2, mask=s_valid, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=s_valid, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(l_s > 0, l_s * tl.math.exp2(m - m_max), 0.0)
    offs_d = tl.arange(0, DIM_PAD)
    o = tl.load(part_out_ptr + part[:, None] * DIM_PAD + offs_d[None, :], mask=s_valid[:, None], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def split_kv_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float, num_splits: int,
                    out: torch.Tensor | None = None, tile_n: int = 32) -> torch.Tensor:
    """Attention of a decode-only step's q [T, H, D] (request i's one token at query_start_loc[i],
    position context_lens[i]) over the paged cache, each (request, KV head) in `num_splits`
    partitions; returns [T, H, D]. The arguments are the varlen kernel's (paged_attention)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_reqs = block_table.shape[0]
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_reqs == 0:
        return out
    check_device(q, k_cache, v_cache, block_table, query_start_loc, context_lens)
    if q.stride(2) != 1:
        q = q.contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache must share strides with a unit last stride")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    queries_per_kv = num_heads // num_kv_heads
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    # Every (token, head, split)'s partial output, max and sum: fp32, as the kernels accumulate.
    part_out = torch.empty((num_tokens, num_heads, num_splits, dim_pad), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((num_tokens, num_heads, num_splits, 2), dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    upcast = is_interpreted() and q.dtype == torch.bfloat16
    _split_kv_kernel[(num_reqs, num_kv_heads, num_splits)](
        part_out, part_ml, q, k_cache, v_cache, block_table, query_start_loc, context_lens,
        scale * 1.4426950408889634, num_heads,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        NUM_SPLITS=num_splits, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], QUERIES_PER_KV=queries_per_kv,
        BLOCK_M=default_block_m(queries_per_kv, 1, q.device.type), TILE_N=tile_n, DIM_PAD=dim_pad,
        PRECISION=precision, UPCAST=upcast,
    )
    _combine_kernel[(num_reqs, num_heads)](
        out, part_out, part_ml, query_start_loc, num_heads, out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
    )
    return out


def compile_for_gpu(arch: int = 90) -> list[str]:
    """Both kernels compiled ahead of time for compute capability `arch` in two variants (see
    triton_kernels.compile_for_gpu); one line per variant."""
    lines = []
    for dt, qpk, dim, splits in (("bf16", 4, 128, 8), ("fp32", 7, 80, 3)):
        ptrs = {n: f"*{dt}" for n in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
        ptrs.update(block_table_ptr="*i32", query_start_loc_ptr="*i32", context_lens_ptr="*i32",
                    part_out_ptr="*fp32", part_ml_ptr="*fp32")
        dim_pad = max(16, triton.next_power_of_2(dim))
        consts = dict(NUM_SPLITS=splits, HEAD_DIM=dim, BLOCK_SIZE=16, QUERIES_PER_KV=qpk,
                      BLOCK_M=max(16, triton.next_power_of_2(qpk)), TILE_N=32, DIM_PAD=dim_pad,
                      PRECISION="ieee" if dt == "fp32" else "tf32", UPCAST=False)
        shared = compile_kernel(_split_kv_kernel, ptrs, consts, arch)
        compile_kernel(_combine_kernel, ptrs, dict(NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
                                                   HEAD_DIM=dim, DIM_PAD=dim_pad), arch)
        lines.append(f"split_kv_decode {dt} gqa={qpk} splits={splits} head_dim={dim}: ok, shared {shared} B")
    return lines
