"""Triton kernels for a decoder layer's elementwise work on CUDA (vLLM's forms), behind
`layer_ops.TritonOps`:

- `fused_add_rms_norm(x, residual, weight, eps)`: residual += x; x = rms_norm(residual) * weight,
  both in place; `rms_norm(x, weight, eps)` writes a new tensor. One program per row, the whole
  row in one block (BLOCK_N = next power of two >= hidden).
- `rope_(qk, positions, cos, sin, num_heads, head_dim)`: rotates the first `num_heads` heads of
  each row of qk (the fused qkv output: q heads then k heads) in place, neox style (halves) or
  GPT-J style (interleaved pairs), over the first `rotary_dim` columns of each head. Program
  (token, head block) reads its token's cos/sin row once for BLOCK_H heads.
- `silu_and_mul(gate_up)`: [T, 2I] → [T, I] = silu(gate) * up. Program (row, column block).

Arithmetic is fp32 inside, rounded to the tensors' dtype exactly where HF's (and `TorchOps`')
torch code rounds, so bf16/fp16 results are those of the torch reference but for the rare
element where a different fp32 summation order or exp/rsqrt rounding tips a rounding:
- norm: the residual sum is rounded (HF adds in the dtype); x·rsqrt(mean(x²)+eps) is rounded to
  the dtype before the weight multiplies it (LlamaRMSNorm: `weight * x.to(input_dtype)`);
- RoPE: cos/sin rounded to the dtype (`RotaryEmbedding.lookup`), each product x·cos, x·sin
  rounded, then their sum;
- SiLU·mul: silu(gate) rounded, then the product.
In fp32 those roundings are no-ops.

Lives beside `layer_ops.py` and `fused_moe_triton.py` (the model's ops, not the worker's); this
module imports triton, so `layer_ops` imports it only when a `TritonOps` is made. Without CUDA
the kernels run under TRITON_INTERPRET=1 on CPU tensors (tests/unit/worker/test_triton_ops.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.attention.triton_kernels import check_device, is_interpreted

MAX_NORM_BLOCK = 65536  # the widest row one norm program takes (elements)


@triton.jit
def _rounded(x, dtype: tl.constexpr, BF16_BITS: tl.constexpr):
    """fp32 x rounded to `dtype` (to nearest, ties to even), as fp32. BF16_BITS: round to bf16 on
    the bits; the interpreter's own fp32 → bf16 cast truncates (a GPU's rounds)."""
    if BF16_BITS:
        u = x.to(tl.uint32, bitcast=True)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        return u.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_x, stride_r, stride_o, n_cols, eps,
    ADD_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BF16_BITS: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = _rounded(x + r, dtype, BF16_BITS)  # HF adds in the dtype: round here
        tl.store(residual_ptr + row * stride_r + cols, x.to(dtype), mask=mask)
    variance = tl.sum(x * x, axis=0) / n_cols
    rstd = tl.rsqrt(variance + eps)
    y = _rounded(x * rstd, dtype, BF16_BITS)  # LlamaRMSNorm: to(input_dtype), then the weight
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, _rounded(w * y, dtype, BF16_BITS).to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    qk_ptr, positions_ptr, cos_ptr, sin_ptr,
    stride_t, stride_cos, stride_sin, num_heads,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
    IS_NEOX: tl.constexpr, BF16_BITS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, HALF_PAD)
    i_mask = i < HALF
    dtype = qk_ptr.dtype.element_ty
    pos = tl.load(positions_ptr + t).to(tl.int64)
    # The tables hold [freqs, freqs] per row: column i < HALF is pair i's angle in both styles.
    c = _rounded(tl.load(cos_ptr + pos * stride_cos + i, mask=i_mask, other=0.0).to(tl.float32), dtype, BF16_BITS)
    s = _rounded(tl.load(sin_ptr + pos * stride_sin + i, mask=i_mask, other=0.0).to(tl.float32), dtype, BF16_BITS)
    if IS_NEOX:
        off1 = i
        off2 = i + HALF
    else:
        off1 = 2 * i
        off2 = 2 * i + 1
    base = qk_ptr + t * stride_t + heads[:, None].to(tl.int64) * HEAD_DIM
    mask = (heads[:, None] < num_heads) & i_mask[None, :]
    x1 = tl.load(base + off1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + off2[None, :], mask=mask, other=0.0).to(tl.float32)
    c = c[None, :]
    s = s[None, :]
    # x·cos + rotate(x)·sin with each product rounded to the dtype, as torch does in it.
    o1 = _rounded(x1 * c, dtype, BF16_BITS) - _rounded(x2 * s, dtype, BF16_BITS)
    o2 = _rounded(x2 * c, dtype, BF16_BITS) + _rounded(x1 * s, dtype, BF16_BITS)
    tl.store(base + off1[None, :], _rounded(o1, dtype, BF16_BITS).to(dtype), mask=mask)
    tl.store(base + off2[None, :], _rounded(o2, dtype, BF16_BITS).to(dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, n_cols,
    BLOCK_N: tl.constexpr, BF16_BITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = _rounded(gate / (1.0 + tl.exp(-gate)), dtype, BF16_BITS)  # torch's silu rounds, then the product
    tl.store(out_ptr + row * stride_o + cols, _rounded(silu * up, dtype, BF16_BITS).to(dtype), mask=mask)


def _rows(x: torch.Tensor, what: str) -> torch.Tensor:
    """x [..., N] as a [rows, N] view with unit column stride (a view: in-place writes must land in x)."""
    if x.stride(-1) != 1:
        raise ValueError(f"{what} needs a unit last stride")
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError as e:
        raise ValueError(f"{what}: rows of {tuple(x.shape)} with strides {x.stride()} are not one 2-D view") from e


def _bf16_bits(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and is_interpreted()


def _norm_warps(block_n: int) -> int:
    return 1 if is_interpreted() else min(16, max(1, block_n // 512))


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
          out: torch.Tensor) -> None:
    """x, residual (or None), out: [rows, N] with unit column strides."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match rows of width {n}")
    if x.shape[0] == 0:
        return
    block_n = triton.next_power_of_2(n)
    if block_n > MAX_NORM_BLOCK:
        raise ValueError(f"rows of {n} elements exceed the norm kernel's one block ({MAX_NORM_BLOCK})")
    r = x if residual is None else residual
    check_device(x, r, weight, out)
    _rms_norm_kernel[(x.shape[0],)](
        x, r, weight.contiguous(), out, x.stride(0), r.stride(0), out.stride(0), n, float(eps),
        ADD_RESIDUAL=residual is not None, BLOCK_N=block_n, BF16_BITS=_bf16_bits(x),
        num_warps=_norm_warps(block_n))


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] as [rows, N] with a unit column stride, for reading (a copy where it must)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * weight over the last dimension, as a new tensor of x's dtype."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _norm(_as_rows(x), None, weight, eps, out.view(-1, x.shape[-1]))
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """residual += x; x = rms_norm(residual) * weight: both written in place (vLLM's form)."""
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and residual {tuple(residual.shape)} {residual.dtype} differ")
    x2 = _rows(x, "fused_add_rms_norm input")
    _norm(x2, _rows(residual, "residual"), weight, eps, out=x2)


def rope_(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
          head_dim: int, is_neox: bool = True, rotary_dim: int | None = None) -> None:
    """Rotate, in place, the first `num_heads` heads of each row of qk [T, >= num_heads * head_dim]
    (q heads then k heads: columns past them, the v heads, are left alone) at positions [T].

    cos/sin: [max_position, >= rotary_dim / 2] tables (fp32), column i < rotary_dim / 2 the angle of
    pair i (RotaryEmbedding's [freqs, freqs] rows qualify). Neox pairs column i with i + rotary_dim / 2,
    GPT-J 2i with 2i + 1; columns past rotary_dim (partial rotary) are left alone."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and in (0, head_dim {head_dim}]")
    if qk.dim() != 2 or qk.stride(1) != 1 or qk.shape[1] < num_heads * head_dim:
        raise ValueError(f"qk must be [T, >= {num_heads * head_dim}] with a unit column stride, got "
                         f"{tuple(qk.shape)} strides {qk.stride()}")
    if positions.shape != (qk.shape[0],):
        raise ValueError(f"positions {tuple(positions.shape)} do not match {qk.shape[0]} rows")
    half = rotary_dim // 2
    if cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.shape[-1] < half or sin.shape[-1] < half:
        raise ValueError("cos/sin tables need >= rotary_dim / 2 columns with a unit stride")
    num_tokens = qk.shape[0]
    if num_tokens == 0 or num_heads == 0:
        return
    positions = positions.contiguous()
    check_device(qk, positions, cos, sin)
    half_pad = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(num_heads), max(1, 2048 // half_pad))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _rope_kernel[grid](
        qk, positions, cos, sin, qk.stride(0), cos.stride(0), sin.stride(0), num_heads,
        HEAD_DIM=head_dim, HALF=half, HALF_PAD=half_pad, BLOCK_H=block_h, IS_NEOX=is_neox,
        BF16_BITS=_bf16_bits(qk), num_warps=1 if is_interpreted() else 4)


def silu_and_mul(gate_up: torch.Tensor, block_n: int = 1024) -> torch.Tensor:
    """gate_up [..., 2I] → silu(gate) * up [..., I] (a new tensor of gate_up's dtype)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dimension {gate_up.shape[-1]} is odd")
    width = gate_up.shape[-1] // 2
    x = _as_rows(gate_up)
    out = torch.empty((*gate_up.shape[:-1], width), dtype=gate_up.dtype, device=gate_up.device)
    if x.shape[0] == 0 or width == 0:
        return out
    check_device(x, out)
    block_n = min(block_n, triton.next_power_of_2(width))
    grid = (x.shape[0], triton.cdiv(width, block_n))
    _silu_and_mul_kernel[grid](x, out.view(-1, width), x.stride(0), width, width, BLOCK_N=block_n,
                               BF16_BITS=_bf16_bits(x), num_warps=1 if is_interpreted() else 4)
    return out


def compile_for_gpu(arch: int = 90) -> list[str]:
    """Compile the kernels ahead of time for an NVIDIA GPU of compute capability `arch` in the
    variants the engine launches (through triton's bundled ptxas; needs no GPU, but triton imported
    without TRITON_INTERPRET). One line per variant."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if is_interpreted():
        raise RuntimeError("compile_for_gpu needs triton imported without TRITON_INTERPRET")
    target = GPUTarget("cuda", arch, 32)

    def compile_one(fn, ptr_types: dict[str, str], consts: dict, floats: tuple[str, ...] = ()) -> None:
        sig = {name: "constexpr" if name in consts else ptr_types.get(name, "fp32" if name in floats else "i32")
               for name in fn.arg_names}
        triton.compile(ASTSource(fn, sig, consts), target=target)

    lines = []
    for dt in ("fp32", "bf16", "fp16"):
        for add, width in ((True, 576), (False, 4096)):
            ptrs = {n: f"*{dt}" for n in ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr")}
            compile_one(_rms_norm_kernel, ptrs, dict(ADD_RESIDUAL=add, BLOCK_N=triton.next_power_of_2(width),
                                                               BF16_BITS=False),
                        floats=("eps",))
            lines.append(f"rms_norm {dt} add_residual={add} width={width}: ok")
        for neox, dim in ((True, 64), (False, 128)):
            ptrs = {"qk_ptr": f"*{dt}", "positions_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
            compile_one(_rope_kernel, ptrs, dict(HEAD_DIM=dim, HALF=dim // 2, HALF_PAD=dim // 2,
                                                 BLOCK_H=min(16, 2048 // (dim // 2)), IS_NEOX=neox,
                                                 BF16_BITS=False))
            lines.append(f"rope {dt} neox={neox} head_dim={dim}: ok")
        compile_one(_silu_and_mul_kernel, {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}"}, dict(BLOCK_N=1024, BF16_BITS=False))
        lines.append(f"silu_and_mul {dt}: ok")
    return lines
