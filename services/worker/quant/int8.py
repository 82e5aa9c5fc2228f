"""`--quantization int8`: an HF checkpoint's linear layers quantized at load to Q8_0 blocks (an
fp16 scale per 32 inputs: finer than per-channel int8), so the GGUF kernels run them."""

from __future__ import annotations

import logging

import torch
from gguf import GGMLQuantizationType
from torch import nn

from services.worker.quant import block_size
from services.worker.quant.install import quant_linear_like

logger = logging.getLogger(__name__)

Q8_0 = int(GGMLQuantizationType.Q8_0)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] float weights → uint8 [out, in / 32 * 34] Q8_0 blocks, bit-identical to
    `gguf.quants.quantize` (ggml's reference: scale = absmax / 127, round half away from zero)."""
    rows = weight.shape[0]
    blocks = weight.detach().float().reshape(-1, block_size(Q8_0))
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inverse
    magnitude = scaled.abs()
    whole = magnitude.floor()
    qs = torch.sign(scaled) * (whole + (2 * (magnitude - whole)).floor())
    scale_bytes = d.half().view(torch.uint8)
    quant_bytes = qs.to(torch.int8).view(torch.uint8)
    return torch.cat((scale_bytes, quant_bytes), dim=1).reshape(rows, -1)


@torch.no_grad()
def quantize_linears_int8(model: nn.Module) -> int:
    """Replace every decoder-layer nn.Linear of `model` (loaded weights) whose input size is a
    whole number of 32-weight blocks by a Q8_0 QuantLinear; the LM head and embedding stay dense
    (they set the logits' precision). Returns how many were replaced."""
    swaps = [(parent, name, child) for parent in model.layers.modules() for name, child in parent.named_children()
             if isinstance(child, nn.Linear)]
    kept = 0
    for parent, name, child in swaps:
        if child.in_features % block_size(Q8_0):
            kept += 1
            continue
        quant = quant_linear_like(child).to(child.weight.device)
        quant.set_parts([(Q8_0, quantize_q8_0(child.weight))])
        if child.bias is not None:
            quant.bias.copy_(child.bias)
        setattr(parent, name, quant)
    if kept:
        logger.warning("--quantization int8: %d linear layers stay dense (inputs not a multiple of %d)",
                       kept, block_size(Q8_0))
    return len(swaps) - kept
