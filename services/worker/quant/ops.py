"""The one dispatch through which every quantized product runs.

For now only the torch path: dequantize the layer's blocks to the activation dtype, then
F.linear. It is correct on every device but materialises the dense weight on each call; the
fused kernels (the C `QuantGemm` on CPU, the Triton kernel on CUDA) are the fast paths and
take over in `quant_matmul` where they support the layer's type.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker.quant import DENSE_TYPES
from services.worker.quant.torch_dequant import dequantize
from services.worker.quant.weights import QuantWeights


def dequantize_part(qtype: int, rows: torch.Tensor) -> torch.Tensor:
    """fp32 weights of one part (a dense part's rows widened)."""
    return rows.float() if qtype in DENSE_TYPES else dequantize(rows, qtype)


def quant_matmul(x: torch.Tensor, layer: QuantWeights, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] @ layer's weights^T (+ bias) → [M, out] in x's dtype."""
    # Fast paths go here, before the torch path: the C kernel on CPU, the Triton kernel on CUDA,
    # each where it supports every part's type (layer.prepared holds what they prepare).
    outs = [F.linear(x, dequantize_part(qtype, rows).to(x.dtype)) for qtype, rows in layer.parts()]
    y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    return y if bias is None else y + bias


def dequantize_rows(layer: QuantWeights, index: torch.Tensor) -> torch.Tensor:
    """fp32 weights of the rows `index` only (an embedding lookup): gathered, then dequantized."""
    if len(layer.qtypes) == 1:
        qtype, rows = layer.parts()[0]
        return dequantize_part(qtype, rows[index])
    dense = torch.cat([dequantize_part(qtype, rows) for qtype, rows in layer.parts()])
    return dense[index]
