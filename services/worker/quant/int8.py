"""`--quantization int8`'s blocks: Q8_0 (an fp16 scale per 32 inputs: finer than per-channel
int8), so the GGUF kernels run an HF checkpoint's linear layers (models/quant_install.py swaps them)."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from services.worker.quant import block_size

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
