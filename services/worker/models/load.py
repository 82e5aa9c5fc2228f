"""Where every model is loaded from: an HF checkpoint directory (loader.py) or a .gguf file whose
weights stay in their blocks (quant_loader.py)."""

from __future__ import annotations

import torch

from services.common.config import is_gguf_file
from services.worker.models.layers import DecoderForCausalLM
from services.worker.models.loader import load_hf_model
from services.worker.models.quant_loader import load_gguf_model


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device, progress: bool = True,
               quantization: str | None = None) -> tuple[DecoderForCausalLM, object]:
    """(model, its HF config): a .gguf file (or `quantization` "gguf") loads with its weights kept
    in their GGUF blocks; otherwise the checkpoint directory's safetensors, with "int8" quantizing
    its linear layers to Q8_0 blocks at load."""
    if quantization == "gguf" or is_gguf_file(model_dir):
        return load_gguf_model(model_dir, dtype, device)
    return load_hf_model(model_dir, dtype, device, progress, quantization)
