"""The one dispatch through which every quantized product runs.

On CPU the C kernels (`kernels.QuantGemm`) compute on the blocks themselves, dequantizing in
registers, for every part whose type they take; on CUDA the Triton kernel (`triton_gemm`) does the
same in its tiles. Elsewhere, and for dense parts, the torch path dequantizes the part's blocks to
the activation dtype, then F.linear: correct on every device, but it materialises the dense weight
on each call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker.quant import DENSE_TYPES
from services.worker.quant.kernels import QuantGemm
from services.worker.quant.torch_dequant import dequantize
from services.worker.quant.weights import QuantWeights


def dequantize_part(qtype: int, rows: torch.Tensor) -> torch.Tensor:
    """fp32 weights of one part (a dense part's rows widened)."""
    return rows.float() if qtype in DENSE_TYPES else dequantize(rows, qtype)


def _cpu_kernels(t: torch.Tensor, layer: QuantWeights) -> QuantGemm | None:
    """The C kernels, where they can run `layer` on the CPU tensor `t` (None: the torch path)."""
    if t.device.type != "cpu":
        return None
    gemm = QuantGemm.load()
    if gemm is None or not all(gemm.supports(q) for q in layer.qtypes if q not in DENSE_TYPES):
        return None
    return gemm


def uses_triton(t: torch.Tensor) -> bool:
    """Whether products on `t`'s device take the Triton kernel (CUDA: the CPU kernels never import
    triton)."""
    return t.device.type == "cuda"


def _triton_matmul(x: torch.Tensor, layer: QuantWeights) -> torch.Tensor:
    from services.worker.quant import triton_gemm

    x2 = x.reshape(-1, layer.in_features)
    outs = [F.linear(x2, rows.to(x.dtype)) if qtype in DENSE_TYPES else
            triton_gemm.matmul(x2, rows, qtype, rows.shape[0], layer.in_features)
            for qtype, rows in layer.parts()]
    y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    return y.reshape(*x.shape[:-1], -1)


def quant_matmul(x: torch.Tensor, layer: QuantWeights, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ layer's weights^T (+ bias) -> [..., out] in x's dtype."""
    if uses_triton(x) and x.dtype in (torch.float16, torch.bfloat16, torch.float32):
        y = _triton_matmul(x, layer)
        return y if bias is None else y + bias
    gemm = _cpu_kernels(x, layer) if x.dtype in (torch.float32, torch.bfloat16) else None
    if gemm is None:
        outs = [F.linear(x, dequantize_part(qtype, rows).to(x.dtype)) for qtype, rows in layer.parts()]
    else:
        x2 = x.reshape(-1, layer.in_features).contiguous()
        fused_bias = bias if layer.is_uniform else None
        outs = [F.linear(x2, rows.to(x.dtype)) if qtype in DENSE_TYPES else
                gemm.matmul(x2, rows, qtype, rows.shape[0], layer.in_features, fused_bias)
                for qtype, rows in layer.parts()]
        outs = [out.reshape(*x.shape[:-1], -1) for out in outs]
        if fused_bias is not None:
            bias = None
    y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    return y if bias is None else y + bias


def dequantize_rows(layer: QuantWeights, index: torch.Tensor) -> torch.Tensor:
    """fp32 weights of the rows `index` only (an embedding lookup): gathered, then dequantized."""
    if len(layer.qtypes) == 1:
        qtype, rows = layer.parts()[0]
        gemm = None if qtype in DENSE_TYPES else _cpu_kernels(rows, layer)
        if gemm is not None:
            return gemm.dequantize(rows, qtype, rows.shape[0], layer.in_features, rows=index)
        return dequantize_part(qtype, rows[index])
    dense = torch.cat([dequantize_part(qtype, rows) for qtype, rows in layer.parts()])
    return dense[index]
