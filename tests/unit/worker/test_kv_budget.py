"""The worker's KV cache budget when --kv-cache-memory does not give one: on CUDA
--gpu-memory-utilization (default 0.9) of the GPU less the peak of a profiled max-size forward
and the CUDA graphs' estimated pool; where no profile runs, the GPU's share less what the process
holds besides its KV cache, 80% of the free memory without it; on CPU the default budget,
--gpu-memory-utilization logged as not applying. The profile's dummy forward runs on the CPU too."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch

from services.common.config import DEFAULT_CPU_KV_CACHE_BYTES
from services.common.sampling_params import SamplingParams
from services.offline.llm import LLM
from services.worker.memory_profile import (
    GRAPH_OVERHEAD_BYTES,
    MemoryProfile,
    graph_pool_estimate,
    kv_cache_budget,
    profile_forward,
)
from services.worker.model_runner import ModelRunner

GIB = 1 << 30
BLOCK_BYTES = 1 << 20


def runner_on(device: str, held_kv_bytes: int = 0, profile: MemoryProfile | None = None) -> SimpleNamespace:
    """The parts of a ModelRunner its budget reads: device, bytes per block, the KV cache it holds,
    its memory profile (None: none runs, as on parallel ranks)."""
    layer = SimpleNamespace(kv_cache=torch.empty(held_kv_bytes, dtype=torch.uint8) if held_kv_bytes else None)
    stub = SimpleNamespace(device=torch.device(device), kv_bytes_per_block=lambda block_size: BLOCK_BYTES,
                           model=SimpleNamespace(attention_layers=lambda: [layer]),
                           profile_memory=lambda block_size: profile)
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


def test_the_budget_is_the_share_less_the_profiled_peak_and_the_graphs() -> None:
    # An 80 GiB GPU: the profile peaked at 20 GiB (weights and activations), 1 GiB outside torch,
    # graphs ~2 GiB; 55 GiB free afterwards.
    profile = MemoryProfile(total=80 * GIB, free=55 * GIB, peak_allocated=20 * GIB, non_torch=GIB, held_kv=0,
                            graph_pool=2 * GIB)
    assert kv_cache_budget(profile, 0.9) == int(0.9 * 80 * GIB) - 23 * GIB
    assert kv_cache_budget(profile, 0.5) == 17 * GIB
    assert kv_cache_budget(profile, 1.0) == 55 * GIB  # never more than is free
    assert kv_cache_budget(profile, 0.2) == 0  # the share does not even hold the model
    # A re-initialisation: the peak counted the 10 GiB cache held, which is replaced (and free again).
    again = dataclasses.replace(profile, peak_allocated=30 * GIB, held_kv=10 * GIB, free=45 * GIB)
    assert kv_cache_budget(again, 0.9) == kv_cache_budget(profile, 0.9)
    # Through the runner: the default utilization is vLLM's 0.9.
    stub = runner_on("cuda", profile=profile)
    assert blocks(stub, None) == (int(0.9 * 80 * GIB) - 23 * GIB) // BLOCK_BYTES
    assert blocks(stub, 0.5) == 17 * GIB // BLOCK_BYTES


def test_the_graph_pool_is_the_largest_graphs_activations() -> None:
    # 2 GiB of activations over 8192 profiled tokens; the largest graph runs 512 rows of 1 + 3 tokens.
    assert graph_pool_estimate(2 * GIB, 8192, 512 * 4, 70) == GIB // 2 + 70 * GRAPH_OVERHEAD_BYTES
    assert graph_pool_estimate(2 * GIB, 8192, 0, 0) == 0  # no graphs


def test_the_profile_forward_runs_on_the_cpu(tiny_model_dir) -> None:
    """The dummy max-size forward (a scratch one-block KV cache per layer, then the LM head over
    max_num_seqs rows) on the CPU, before and after the KV cache exists; the engine still
    generates the same tokens after it."""
    with LLM(tiny_model_dir("llama"), dtype="float32", max_num_seqs=3, max_num_batched_tokens=40,
             max_model_len=64, kv_cache_memory_bytes=4 << 20, seed=0) as llm:
        runner = llm.worker.runner
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        want = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0].outputs[0].token_ids
        caches = [layer.kv_cache for layer in runner.model.attention_layers()]
        logits = profile_forward(runner.model, runner.attn_backend, runner.max_num_batched_tokens,
                                 runner.max_num_seqs, runner.block_size, runner.dtype, runner.device)
        assert logits.shape == (3, runner.vocab_size) and torch.isfinite(logits).all()
        assert all(layer.kv_cache is cache for layer, cache in zip(runner.model.attention_layers(), caches,
                                                                   strict=True))
        assert runner.profile_memory(runner.block_size) is None  # CPU: no profile, the CPU budget rule
        got = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0].outputs[0].token_ids
        assert list(got) == list(want)
        layers = runner.model.attention_layers()
        saved = [layer.kv_cache for layer in layers]
        for layer in layers:
            layer.kv_cache = None  # as before InitKVCache
        try:
            profile_forward(runner.model, runner.attn_backend, 17, 2, runner.block_size, runner.dtype, runner.device)
            assert all(layer.kv_cache is None for layer in layers)
        finally:
            for layer, cache in zip(layers, saved, strict=True):
                layer.kv_cache = cache
