"""Which attention backend a worker runs (--attention-backend, or the device's default)."""

from __future__ import annotations

import logging

import torch

from services.worker.attention.base import AttentionBackend

logger = logging.getLogger("myvllm.worker")


def get_attention_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """`None` picks automatically: triton on CUDA, the cpu kernel on CPU. The cpu backend
    compiles a C kernel; when that cannot be built (no compiler, a failed build) the torch
    reference is used instead, with a warning that says why."""
    if name is None:
        name = "triton" if device.type == "cuda" else "cpu"
    if name == "cpu":
        from services.worker.attention.cpu_backend import CpuAttentionBackend
        try:
            return CpuAttentionBackend()
        except (RuntimeError, OSError) as e:
            logger.warning("attention backend 'cpu' cannot be built (%s); falling back to 'torch'", e)
            name = "torch"
    if name == "torch":
        from services.worker.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "triton":
        from services.worker.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch', 'cpu' or 'triton'")
