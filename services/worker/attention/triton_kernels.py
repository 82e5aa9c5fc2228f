"""Triton kernels for paged attention: the KV store and one varlen attention over a ragged batch.

`store_kv`: program t copies token t's K and V [KVH, D] into the paged cache at
slot_mapping[t] (block = slot // block_size, offset = slot % block_size); slot -1 (padding)
is skipped.

`paged_attention`: one launch for the whole step, prefill chunks (with prior context in the
cache) and decodes alike. The grid is (query blocks, KV heads). A program takes BLOCK_Q
consecutive query tokens of one request and all QUERIES_PER_KV query heads that share its
KV head, as one [BLOCK_M = BLOCK_Q * QUERIES_PER_KV (padded), D] tile, so each K/V tile
read from the cache serves every query head of the group (GQA). Query j of request i sits
at absolute position context_lens[i] + j and attends causally to keys 0..that position,
read through block_table in tiles of TILE_N keys (a tile may span cache blocks; each key
finds its block in the table). Softmax is online (running max and sum, exp2), accumulation
in fp32.

Query blocks are numbered per request without a host-side table: request i's blocks start
at query_start_loc[i] // BLOCK_Q + i, so T // BLOCK_Q + B programs always cover the batch
and a program finds its request by binary search over query_start_loc (programs past the
end of their request's queries exit at once). The grid thus depends only on the shapes,
which CUDA graphs will need.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    num_kv_heads, head_dim, block_size,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    src_k = k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d
    src_v = v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d
    dst = blk * stride_cb + off * stride_cs + h * stride_ch + d
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST: the interpreter multiplies bf16 operands as their raw uint16 bits, so there the
    # operands go to fp32 first (values unchanged; on a GPU the native bf16 MMA runs).
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_table_ptr, query_start_loc_ptr, context_lens_ptr,
    scale_log2,  # softmax scale * log2(e): scores go through exp2
    num_reqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, DIM_PAD: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    # The request whose query blocks hold block `pid`: the last i with qsl[i] // BLOCK_Q + i <= pid.
    lo = pid * 0  # int32 tensors from the start, whatever the launcher specialised
    hi = pid * 0 + num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    req = lo - 1
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block = pid - (q_start // BLOCK_Q + req)
    if q_block * BLOCK_Q >= q_len:
        return
    context_len = tl.load(context_lens_ptr + req)

    # Row r of the tile: query token q_block * BLOCK_Q + r // QUERIES_PER_KV, head r % QUERIES_PER_KV.
    offs_m = tl.arange(0, BLOCK_M)
    q_local = q_block * BLOCK_Q + offs_m // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_valid = (offs_m // QUERIES_PER_KV < BLOCK_Q) & (q_local < q_len)
    q_pos = context_len + q_local  # absolute position of each row's query
    token = (q_start + q_local).to(tl.int64)
    offs_d = tl.arange(0, DIM_PAD)
    d_valid = offs_d < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)

    # Keys up to the last query of this block (causal); the block table covers all of them.
    last_q = tl.minimum((q_block + 1) * BLOCK_Q, q_len) - 1
    num_keys = context_len + last_q + 1
    offs_n = tl.arange(0, TILE_N)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for start in range(0, num_keys, TILE_N):
        key_pos = start + offs_n
        key_valid = key_pos < num_keys
        blk = tl.load(bt_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (key_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache_ptr + kv_off[None, :] + offs_d[:, None],
                    mask=key_valid[None, :] & d_valid[:, None], other=0.0)  # [DIM_PAD, TILE_N]
        s = dot(q, k.to(q.dtype), PRECISION, UPCAST) * scale_log2      # [BLOCK_M, TILE_N] fp32
        causal = (key_pos[None, :] <= q_pos[:, None]) & key_valid[None, :]
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with nothing visible yet (padding rows) keep m = -inf: subtract 0 there, not -inf.
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.math.exp2(s - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :],
                    mask=key_valid[:, None] & d_valid[None, :], other=0.0)  # [TILE_N, DIM_PAD]
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])


def is_interpreted() -> bool:
    """Whether these kernels run under TRITON_INTERPRET (decided when this module was imported)."""
    return type(_paged_attention_kernel).__name__ == "InterpretedFunction"


def interpreter_consistent() -> bool:
    """False when these kernels are interpreted but triton itself was imported before TRITON_INTERPRET
    was set: triton's own helpers (tl.zeros, tl.max, ...) are then GPU functions the interpreter cannot run."""
    return is_interpreted() == (type(tl.zeros).__name__ == "InterpretedFunction")


def check_device(*tensors: torch.Tensor) -> None:
    if not interpreter_consistent():
        raise RuntimeError("TRITON_INTERPRET was set after triton was imported: set it before the first "
                           "`import triton` (in a fresh process)")
    if not is_interpreted() and any(t.device.type != "cuda" for t in tensors):
        raise RuntimeError("the triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before "
                           "triton kernels are first imported, to run them on the CPU)")


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, KVH, D] → k_cache/v_cache [num_blocks, block_size, KVH, D] at slot_mapping [T] (-1: skip)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    check_device(k, v, k_cache, v_cache, slot_mapping)
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache must share strides with a unit last stride")
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, head_dim, k_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
    )


def default_block_m(queries_per_kv: int, max_query_len: int, device_type: str) -> int:
    """Rows per program: 16 for decode-only steps (the tensor-core minimum), 64 with prefills on CUDA."""
    block_m = 64 if (max_query_len > 1 and device_type == "cuda") else 16
    return max(block_m, triton.next_power_of_2(queries_per_kv))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
                    max_query_len: int, out: torch.Tensor | None = None, block_m: int | None = None,
                    tile_n: int = 32) -> torch.Tensor:
    """Causal attention of q [T, H, D] over the paged cache; returns [T, H, D] (rows of tokens past
    query_start_loc[-1], i.e. padding, are left unwritten).

    block_table [B, max_blocks] int32, query_start_loc [B+1] int32, context_lens [B] int32.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_reqs = block_table.shape[0]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_reqs == 0:
        return out
    check_device(q, k_cache, v_cache, block_table, query_start_loc, context_lens)
    if q.stride(2) != 1:
        q = q.contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache must share strides with a unit last stride")
    if tile_n < 16 or tile_n & (tile_n - 1):
        raise ValueError(f"tile_n must be a power of two >= 16, got {tile_n}")
    queries_per_kv = num_heads // num_kv_heads
    if block_m is None:
        block_m = default_block_m(queries_per_kv, max_query_len, q.device.type)
    if block_m < queries_per_kv or block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= max(16, queries per kv head), got {block_m}")
    block_q = block_m // queries_per_kv
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_table, query_start_loc, context_lens,
        scale * 1.4426950408889634,
        num_reqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        QUERIES_PER_KV=queries_per_kv, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)),  # tl.dot needs K >= 16
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=is_interpreted() and q.dtype == torch.bfloat16,
    )
    return out


def compile_kernel(fn, ptr_types: dict[str, str], consts: dict, arch: int) -> int:
    """Compile `fn` ahead of time for compute capability `arch` (pointer arguments typed by
    `ptr_types`, the constexprs `consts`, scale_log2 fp32, every other argument i32); returns the
    shared memory it uses. Needs triton imported without TRITON_INTERPRET."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if is_interpreted():
        raise RuntimeError("compile_for_gpu needs triton imported without TRITON_INTERPRET")
    sig = {name: "constexpr" if name in consts else ptr_types.get(name, "fp32" if name == "scale_log2" else "i32")
           for name in fn.arg_names}
    return getattr(triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", arch, 32)).metadata,
                   "shared", -1)


def compile_for_gpu(arch: int = 90) -> list[str]:
    """Compile the kernels ahead of time for an NVIDIA GPU of compute capability `arch` (90: Hopper) in
    the variants the engine launches, through triton's bundled ptxas. Needs no GPU, but triton imported
    without TRITON_INTERPRET: it catches code that the interpreter runs but the compiler rejects.
    Returns one line per variant (shared memory used)."""
    def compile_one(fn, ptr_types: dict[str, str], consts: dict) -> int:
        return compile_kernel(fn, ptr_types, consts, arch)

    lines = []
    for dt, heads, dim in (("bf16", 8, 128), ("fp32", 3, 80)):
        ptrs = {n: f"*{dt}" for n in ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")}
        ptrs["slot_mapping_ptr"] = "*i64"
        shared = compile_one(_store_kv_kernel, ptrs, dict(HEADS_PAD=triton.next_power_of_2(heads),
                                                          DIM_PAD=triton.next_power_of_2(dim)))
        lines.append(f"store_kv {dt} kv_heads={heads} head_dim={dim}: ok, shared {shared} B")
    for dt, qpk, block_m, dim in (("bf16", 2, 64, 128), ("bf16", 2, 16, 128), ("fp16", 1, 16, 64),
                                  ("fp32", 3, 16, 64), ("fp32", 7, 32, 80), ("bf16", 4, 16, 8)):
        ptrs = {n: f"*{dt}" for n in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
        ptrs.update(block_table_ptr="*i32", query_start_loc_ptr="*i32", context_lens_ptr="*i32")
        consts = dict(HEAD_DIM=dim, BLOCK_SIZE=16, QUERIES_PER_KV=qpk, BLOCK_M=block_m, BLOCK_Q=block_m // qpk,
                      TILE_N=32, DIM_PAD=max(16, triton.next_power_of_2(dim)),
                      PRECISION="ieee" if dt == "fp32" else "tf32", UPCAST=False)
        shared = compile_one(_paged_attention_kernel, ptrs, consts)
        lines.append(f"paged_attention {dt} gqa={qpk} block_m={block_m} head_dim={dim}: ok, shared {shared} B")
    return lines
