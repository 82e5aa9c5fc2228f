"""The measurements behind `myvllm bench roofline` (roofline.py holds the arithmetic and the table).

Machine limits first, while nothing else of the bench holds the cores: the read bandwidth and
the GEMM peak with 1 and N threads. Then the engine, one dtype at a time through the offline
`LLM` (as `bench latency` runs it): batch-1 ITL, and a batched decode step's time as the
difference of two runs of the same number of requests, short and long outputs, over their
output-length difference (loading, prefill and the ramp-up are the same in both and cancel).
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.bandwidth_floor import read_bandwidth_bytes_s, safetensors_weight_bytes
from services.entrypoints.bench.roofline import EngineFigures, MachineLimits, ModelShape, decode_step_flops
from services.entrypoints.bench.workload import (
    BenchRequest,
    MyVllmPeer,
    SamplingKnobs,
    log,
    random_requests,
    torch_threads,
    warmup_request,
)

# Square-ish shapes (M, K, N) large enough to run at the kernels' full rate.
GEMM_SHAPES = ((1024, 1024, 1024), (2048, 2048, 2048), (1024, 4096, 2048))
QUICK_GEMM_SHAPES = ((256, 256, 256),)
QUICK_BUFFER_BYTES = 64 << 20
# Random-prompt streams of the engine runs (warmup_request's is 1): no run shares a prefix.
_LATENCY_STREAM = 2
_BATCH_STREAM = 100


@dataclass(frozen=True)
class EngineWorkload:
    """Sizes of the engine runs: batch-1 latency and the batched decode step."""

    latency_input_len: int = 32
    latency_output_len: int = 32
    latency_iters: int = 2
    batch: int = 64
    batch_input_len: int = 16
    batch_short_output: int = 8
    batch_long_output: int = 24
    batch_repeats: int = 2

    @classmethod
    def quick(cls, batch: int) -> EngineWorkload:
        return cls(latency_input_len=8, latency_output_len=4, latency_iters=1, batch=batch, batch_input_len=8,
                   batch_short_output=2, batch_long_output=10, batch_repeats=2)


def measure_machine(thread_counts: Iterable[int], dtypes: Sequence[str], parts: Iterable[str],
                    quick: bool = False) -> MachineLimits:
    """The read bandwidth and the GEMM peak per dtype, at each thread count (parts: "bandwidth",
    "gemm"; a part left out stays empty)."""
    parts, thread_counts = set(parts), sorted(set(thread_counts))
    bandwidth: dict[int, float] = {}
    gemm: dict[str, dict[int, float]] = {}
    if "bandwidth" in parts:
        for threads in thread_counts:
            log(f"measuring the read bandwidth with {threads} thread(s)")
            bandwidth[threads] = read_bandwidth_bytes_s(threads, QUICK_BUFFER_BYTES if quick else None,
                                                        repeats=2 if quick else 3)
    if "gemm" in parts:
        for dtype in dtypes:
            for threads in thread_counts:
                log(f"measuring the {dtype} GEMM peak with {threads} thread(s)")
                gemm.setdefault(dtype, {})[threads] = gemm_peak_flops_s(
                    dtype, threads, QUICK_GEMM_SHAPES if quick else GEMM_SHAPES, repeats=2 if quick else 3)
    return MachineLimits(bandwidth, gemm)


def gemm_peak_flops_s(dtype: str, threads: int, shapes: Iterable[tuple[int, int, int]], repeats: int = 3) -> float:
    """The best FLOP/s of `torch.mm` [M, K] x [K, N] over `shapes` with `threads` intra-op threads,
    each shape's best of `repeats` after one untimed call."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = 0.0
        for m, k, n in shapes:
            a = torch.full((m, k), 0.01, dtype=getattr(torch, dtype))
            b = torch.full((k, n), 0.01, dtype=getattr(torch, dtype))
            torch.mm(a, b)
            for _ in range(repeats):
                start = time.perf_counter()
                torch.mm(a, b)
                best = max(best, 2.0 * m * k * n / (time.perf_counter() - start))
        return best
    finally:
        torch.set_num_threads(previous)


def model_shape(model_dir: str) -> ModelShape:
    """A checkpoint directory's decode-step shape: parameters from the safetensors headers (the
    ones a token reads: the input embedding only when it is the LM head), the attention's sizes
    from config.json."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        config: dict[str, Any] = json.load(f)
    config = config.get("text_config", config)
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return ModelShape(params=safetensors_weight_bytes(model_dir, 1), layers=int(config["num_hidden_layers"]),
                      heads=heads, head_dim=head_dim)


def measure_engine(engine_kwargs: dict[str, Any], dtype: str, parts: Iterable[str], workload: EngineWorkload,
                   vocab_size: int, seed: int) -> EngineFigures:
    """Load my-vllm at `dtype` once and run the parts asked for ("latency", "batch")."""
    import torch

    parts = set(parts)
    model = engine_kwargs["model"]
    shape = model_shape(model)
    dtype_bytes = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    knobs = SamplingKnobs()
    kwargs = {**engine_kwargs, "dtype": dtype,
              "max_num_seqs": max(int(engine_kwargs.get("max_num_seqs") or 0), workload.batch)}
    log(f"loading my-vllm ({dtype})")
    peer = MyVllmPeer(kwargs)
    try:
        peer.generate([warmup_request(vocab_size, seed)], knobs)
        threads = torch_threads()
        itl = _batch1_itl(peer, knobs, workload, vocab_size, seed) if "latency" in parts else None
        step = _batched_step_s(peer, knobs, workload, vocab_size, seed) if "batch" in parts else None
    finally:
        peer.close()
        del peer
        gc.collect()  # the next dtype's engine gets the memory to itself
    step_flops = None
    if step is not None:
        # Each differenced step attends over the prompt and the outputs so far: their midpoint.
        context = workload.batch_input_len + (workload.batch_short_output + workload.batch_long_output) / 2
        step_flops = decode_step_flops(shape, workload.batch, context)
    return EngineFigures(dtype=dtype, threads=threads, weight_bytes=shape.params * dtype_bytes, itl_s=itl,
                         batch=workload.batch if "batch" in parts else 0, step_s=step, step_flops=step_flops)


def _batch1_itl(peer: MyVllmPeer, knobs: SamplingKnobs, workload: EngineWorkload, vocab_size: int,
                seed: int) -> float:
    """Mean (E2E - TTFT) / (output_len - 1) over the iterations, a fresh prompt for every run."""
    log("measuring batch-1 ITL")
    n, out = workload.latency_iters, workload.latency_output_len
    prompts = random_requests(2 * n, workload.latency_input_len, workload.latency_input_len, out, out,
                              vocab_size, seed, stream=_LATENCY_STREAM)
    itls = []
    for i in range(n):
        ttft = peer.generate([BenchRequest(prompts[2 * i].prompt_token_ids, 1)], knobs)
        e2e = peer.generate([BenchRequest(prompts[2 * i + 1].prompt_token_ids, out)], knobs)
        itls.append((e2e - ttft) / (out - 1))
    return sum(itls) / len(itls)


def _batched_step_s(peer: MyVllmPeer, knobs: SamplingKnobs, workload: EngineWorkload, vocab_size: int,
                    seed: int) -> float | None:
    """Seconds per pure decode step of `workload.batch` running requests: (best long run - best
    short run) / (their output-length difference); None when noise left no positive difference.
    Fresh prompts for every run: no prefix-cache hits."""
    log(f"measuring a {workload.batch}-request decode step")
    lengths = (workload.batch_short_output, workload.batch_long_output)
    best = []
    for which, length in enumerate(lengths):
        times = []
        for r in range(workload.batch_repeats):
            requests = random_requests(workload.batch, workload.batch_input_len, workload.batch_input_len, length,
                                       length, vocab_size, seed, stream=_BATCH_STREAM + 2 * r + which)
            times.append(peer.generate(requests, knobs))
        best.append(min(times))
    difference = best[1] - best[0]
    return difference / (lengths[1] - lengths[0]) if difference > 0 else None
