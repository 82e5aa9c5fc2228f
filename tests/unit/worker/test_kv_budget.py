"""The worker's KV cache budget when --kv-cache-memory does not give one: --gpu-memory-utilization
on CUDA (the GPU's share less what the process holds besides its KV cache), 80% of the free
memory without it, and on CPU the default budget, --gpu-memory-utilization logged as not applying."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from services.common.config import DEFAULT_CPU_KV_CACHE_BYTES
from services.worker.model_runner import ModelRunner

GIB = 1 << 30
BLOCK_BYTES = 1 << 20


def runner_on(device: str, held_kv_bytes: int = 0) -> SimpleNamespace:
    """The parts of a ModelRunner its budget reads: device, bytes per block, the KV cache it holds."""
    layer = SimpleNamespace(kv_cache=torch.empty(held_kv_bytes, dtype=torch.uint8) if held_kv_bytes else None)
    stub = SimpleNamespace(device=torch.device(device), kv_bytes_per_block=lambda block_size: BLOCK_BYTES,
                           model=SimpleNamespace(attention_layers=lambda: [layer]))
    for name in ("_gpu_kv_budget", "_free_bytes_for_kv", "_held_kv_bytes"):
        setattr(stub, name, getattr(ModelRunner, name).__get__(stub))
    return stub


def blocks(stub: SimpleNamespace, utilization: float | None, kv_bytes: int | None = None) -> int:
    return ModelRunner.num_blocks_for_budget(stub, 16, kv_bytes, utilization)


def test_cuda_budget_is_the_share_less_what_the_process_holds_besides_its_kv(monkeypatch) -> None:
    # A 10 GiB GPU, 6 GiB free; this process has 3 GiB reserved, 1 GiB of it its KV cache.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (6 * GIB, 10 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * GIB)
    stub = runner_on("cuda", held_kv_bytes=GIB)
    assert blocks(stub, 0.5) == (5 * GIB - 2 * GIB) // BLOCK_BYTES  # half the GPU, less the 2 GiB of weights
    assert blocks(stub, 1.0) == 7 * GIB // BLOCK_BYTES  # capped by what is free (6) plus its own cache (1)
    assert blocks(stub, None) == int(7 * GIB * 0.8) // BLOCK_BYTES  # the worker's own rule, unchanged
    assert blocks(stub, 0.5, kv_bytes=GIB) == GIB // BLOCK_BYTES  # --kv-cache-memory wins


def test_cpu_ignores_it_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    stub = runner_on("cpu")
    with caplog.at_level(logging.WARNING):
        assert blocks(stub, 0.5) == DEFAULT_CPU_KV_CACHE_BYTES // BLOCK_BYTES
    assert "--gpu-memory-utilization does not apply on CPU" in caplog.text
    caplog.clear()
    assert blocks(stub, None) == DEFAULT_CPU_KV_CACHE_BYTES // BLOCK_BYTES and not caplog.text
