"""How much of a GPU the KV cache may take, from a profiled forward (vLLM's `determine_available_memory`).

Before the KV cache exists the worker runs one dummy forward at the largest step it will ever
run (max_num_batched_tokens tokens, one prompt, then the LM head over max_num_seqs rows) and
measures the allocator's peak. The KV cache then gets

    utilization * total - (peak + non_torch + graph_pool)

where peak is everything torch held at the profile's peak (weights, activations, the logits)
less a KV cache this worker already holds (a re-initialisation replaces it), non_torch what
the process uses outside torch's allocator (the CUDA context, cuBLAS workspaces, NCCL
buffers), and graph_pool an estimate of the CUDA graphs' private memory pool, which the
graphs captured after the cache keep for their activations. Never more than is free.

`kv_cache_budget` and `graph_pool_estimate` are pure functions of the measurements, so the
rule is tested without a GPU; `profile_forward` runs the same dummy forward on any device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator

import numpy as np
import torch

from services.worker.attention.base import AttentionMetadata, forward_context

logger = logging.getLogger("myvllm.worker")

# vLLM's --gpu-memory-utilization default: the share of the GPU the worker plans for.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Bytes a captured graph holds besides its activations (its node and launch records); a rough
# per-graph allowance, small next to the pool itself.
GRAPH_OVERHEAD_BYTES = 2 << 20


@dataclasses.dataclass(frozen=True)
class MemoryProfile:
    """The device's memory as the profiled forward left it (bytes)."""

    total: int             # the device's memory
    free: int              # free after the profile (the driver's view)
    peak_allocated: int    # torch's allocator peak during the profile (weights + activations + logits)
    non_torch: int         # in use but not torch's: (total - free) - reserved
    held_kv: int           # a KV cache this worker already holds (counted in peak_allocated)
    graph_pool: int = 0    # the CUDA graphs' estimated pool (0: no graphs)


def graph_pool_estimate(activation_bytes: int, profile_tokens: int, largest_graph_tokens: int,
                        num_graphs: int) -> int:
    """The graphs share one pool that the largest graph's forward sizes (the smaller ones reuse
    it): the profile's activations scaled to that graph's tokens, plus each graph's overhead."""
    if num_graphs == 0:
        return 0
    per_token = max(activation_bytes, 0) / max(profile_tokens, 1)
    return int(per_token * largest_graph_tokens) + num_graphs * GRAPH_OVERHEAD_BYTES


def kv_cache_budget(profile: MemoryProfile, utilization: float) -> int:
    """KV cache bytes: utilization * total less what the process needs besides its KV cache at
    its peak, never more than is free (counting a held cache, which is replaced), never < 0."""
    besides_kv = profile.peak_allocated - profile.held_kv + profile.non_torch + profile.graph_pool
    share = int(utilization * profile.total) - besides_kv
    return max(min(share, profile.free + profile.held_kv), 0)


@contextlib.contextmanager
def scratch_kv_cache(model: torch.nn.Module, block_size: int, dtype: torch.dtype,
                     device: torch.device) -> Iterator[None]:
    """Layers without a KV cache get a one-block one for the dummy forward (every token's K/V
    goes to that block, whose contents nobody reads afterwards); their own caches come back after."""
    layers = model.attention_layers()
    saved = [layer.kv_cache for layer in layers]
    try:
        for layer in layers:
            if layer.kv_cache is None:
                layer.kv_cache = torch.zeros((2, 1, block_size, layer.num_kv_heads, layer.head_dim), dtype=dtype,
                                             device=device)
        yield
    finally:
        for layer, cache in zip(layers, saved, strict=True):
            layer.kv_cache = cache


@torch.inference_mode()
def profile_forward(model: torch.nn.Module, backend, num_tokens: int, num_logits: int, block_size: int,
                    dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One prompt of `num_tokens` tokens (token 0 at positions 0..n-1) through the model, its K/V
    stored in slot 0 of a scratch block, then the LM head over `num_logits` rows: the largest
    step's activations and logits. Returns the logits (so nothing is optimised away)."""
    width = -(-num_tokens // block_size)
    meta = AttentionMetadata.from_host(np.zeros(num_tokens, dtype=np.int64), np.array([0, num_tokens]),
                                       np.array([num_tokens]), np.array([0]), np.zeros((1, width), dtype=np.int32),
                                       block_size, device)
    meta.backend_data = backend.prepare(meta)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device)
    with scratch_kv_cache(model, block_size, dtype, device), forward_context(backend, meta):
        hidden = model(ids, positions)
    rows = hidden[-1:].expand(num_logits, -1)
    return model.compute_logits(rows)


def measure_cuda(run_profile, device: torch.device, held_kv: int, graph_tokens: int, num_graphs: int,
                 profile_tokens: int) -> MemoryProfile:
    """Run `run_profile()` between the allocator's peak counters and read the device's memory."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run_profile()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max((total - free) - torch.cuda.memory_reserved(device), 0)
    torch.cuda.empty_cache()  # the profile's activations go back: the cache may have them
    free, _ = torch.cuda.mem_get_info(device)
    pool = graph_pool_estimate(peak - before, profile_tokens, graph_tokens, num_graphs)
    profile = MemoryProfile(total=total, free=free, peak_allocated=peak, non_torch=non_torch, held_kv=held_kv,
                            graph_pool=pool)
    logger.info("memory profile: %.2f GiB total, peak %.2f GiB (activations %.2f GiB over %d tokens), "
                "%.2f GiB outside torch, CUDA graphs ~%.2f GiB", total / 2**30, peak / 2**30,
                (peak - before) / 2**30, profile_tokens, non_torch / 2**30, pool / 2**30)
    return profile
