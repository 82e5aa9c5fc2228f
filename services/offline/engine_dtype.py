"""The dtype the offline engine's worker runs for a requested one, settled before anything loads:
benchmarks fix "auto" once with it so that every peer (and the report) runs the dtype my-vllm
picks on this machine."""

from __future__ import annotations

import torch

from services.common.config import resolve_dtype_name
from services.worker.models.cpu_linear import dtype_probe


def engine_dtype(dtype: str, model: str | None = None, quantization: str | None = None) -> str:
    """`dtype`, with "auto" resolved as a single-rank worker on this machine's device resolves it:
    on a CPU with bf16 instructions by timing `model`'s projection through the worker's linear
    kernel (not for a quantized model, whose GEMMs are not the dense ones)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_dtype_name(dtype, device, cuda_bf16=device == "cuda" and torch.cuda.is_bf16_supported(),
                              probe=dtype_probe(model) if model and not quantization else None)
