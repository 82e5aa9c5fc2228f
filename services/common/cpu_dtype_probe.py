"""`--dtype auto` on a CPU with bf16 instructions, decided by measuring this machine's GEMMs.

bf16 instructions alone do not make bf16 the faster dtype: with AVX-512 bf16 dot products but
no AMX tiles a bf16 GEMM may run at about half the fp32 rate, while bf16 still halves the bytes
a memory-bound decode step reads. So at start-up the model's [M, hidden] x [hidden,
intermediate] projection runs in both dtypes, through the kernel the worker's linear layers
use (`kernel`; plain `torch.mm` by default), at M=1 (batch-1 decode: each product reads its own
copy of the weight, past the core's private caches, as decode streams the weights from memory)
and at M=64 (a batched step: compute-bound), and `choose_dtype_by_timings` (a pure function of
those timings) picks the dtype with the better overall speed.

The measurement is for dense checkpoints: a GGUF or int8 model runs its projections through the
quantized kernels, whose speed these dense products do not describe (the instruction-flag rule
of `services.common.config.choose_cpu_dtype` decides there).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["GemmTimings", "KernelFactory", "choose_dtype_by_timings", "gemm_shape", "measure_gemm_timings",
           "probe_model"]

# weight [out, in] -> the product x -> x @ weight.T as the worker computes it (tensors: torch's).
KernelFactory = Callable[[Any], Callable[[Any], Any]]

BATCHED_ROWS = 64
# M=1 products cycle through copies of the weight adding up to at least this many fp32 bytes:
# far past a core's L2, so a product pays for reading its weight as decode does.
STREAMED_BYTES = 32 << 20
MIN_STREAMED_COPIES = 4
# Larger projections are measured on a slice of their columns: GEMM rates at such sizes no
# longer depend on the shape, and the probe must stay well under a second.
MAX_WEIGHT_BYTES = 32 << 20


@dataclass(frozen=True)
class GemmTimings:
    """Best seconds per `torch.mm` of [M, hidden] x [hidden, intermediate], by dtype and M."""

    hidden: int
    intermediate: int
    fp32_m1: float
    bf16_m1: float
    fp32_m64: float
    bf16_m64: float

    @property
    def bf16_speedup_m1(self) -> float:
        """fp32's time over bf16's at M=1 (>1: bf16 decodes a single sequence faster)."""
        return self.fp32_m1 / self.bf16_m1

    @property
    def bf16_speedup_m64(self) -> float:
        """fp32's time over bf16's at M=64 (>1: bf16 runs a batched step faster)."""
        return self.fp32_m64 / self.bf16_m64

    def describe(self) -> str:
        def us(seconds: float) -> str:
            return f"{seconds * 1e6:.0f}"

        return (f"{self.hidden}x{self.intermediate} products: M=1 fp32 {us(self.fp32_m1)} us, bf16 "
                f"{us(self.bf16_m1)} us; M={BATCHED_ROWS} fp32 {us(self.fp32_m64)} us, bf16 {us(self.bf16_m64)} us")


def choose_dtype_by_timings(timings: GemmTimings) -> tuple[str, str]:
    """("bfloat16" | "float32", why). The engine's time splits between batch-1 decode (latency)
    and batched steps (throughput), neither of which dominates in general, so the two speedups
    count alike: bf16 when their geometric mean is at least 1. A tie goes to bf16, which also
    halves the weights' and the KV cache's memory."""
    m1, m64 = timings.bf16_speedup_m1, timings.bf16_speedup_m64
    overall = math.sqrt(m1 * m64)
    chosen = "bfloat16" if overall >= 1.0 else "float32"
    why = (f"bf16 runs {m1:.2f}x fp32's speed at M=1 and {m64:.2f}x at M={BATCHED_ROWS} (geometric mean "
           f"{overall:.2f} {'>=' if chosen == 'bfloat16' else '<'} 1; {timings.describe()})")
    return chosen, why


def gemm_shape(model: str | None) -> tuple[int, int] | None:
    """(hidden, intermediate) of a checkpoint directory's config.json; None for anything else
    (a .gguf file, a config without those sizes, no model)."""
    if not model or not os.path.isdir(model):
        return None
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    config = config.get("text_config", config)  # multimodal wrappers keep the language model's sizes inside
    hidden, intermediate = config.get("hidden_size"), config.get("intermediate_size")
    if not isinstance(hidden, int) or not isinstance(intermediate, int) or hidden < 1 or intermediate < 1:
        return None
    return hidden, intermediate


def probe_model(model: str | None, kernel: KernelFactory | None = None) -> GemmTimings | None:
    """The timings of `model`'s projection (see `measure_gemm_timings`); None where it has no
    checkpoint shape to time (`gemm_shape`)."""
    shape = gemm_shape(model)
    return None if shape is None else measure_gemm_timings(*shape, kernel=kernel)


def measure_gemm_timings(hidden: int, intermediate: int, repeats: int = 3,
                         kernel: KernelFactory | None = None) -> GemmTimings:
    """Time the projection's products in fp32 and bf16 at M=1 and M=64 on one thread, each
    product on its own, keeping the best of its `repeats` (or of the streamed copies).

    One thread: the choice is a ratio of per-core rates (AMX or not, bf16 dot products or
    software conversion), and a single thread reads them true beside other load, where an
    OpenMP team waits milliseconds at every barrier for a member that lost its core. The best
    of many short calls likewise: other load only ever slows a call."""
    import torch

    if hidden < 1 or intermediate < 1 or repeats < 1:
        raise ValueError(f"hidden, intermediate and repeats must be positive, got {hidden}, {intermediate}, "
                         f"{repeats}")
    kernel = kernel or _torch_mm
    columns = max(1, min(intermediate, MAX_WEIGHT_BYTES // (4 * hidden)))
    copies = max(MIN_STREAMED_COPIES, -(-STREAMED_BYTES // (4 * hidden * columns)))
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        figures = {}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            # A constant fill: GEMM speed does not depend on the values, and no denormal slows it.
            products = [kernel(torch.full((columns, hidden), 0.01, dtype=dtype)) for _ in range(copies)]
            single = torch.full((1, hidden), 0.01, dtype=dtype)
            batched = torch.full((BATCHED_ROWS, hidden), 0.01, dtype=dtype)
            products[0](batched)  # a kernel's first call picks and prepares its path
            products[0](single)
            figures[f"{name}_m1"] = _best_call(single, products, repeats)
            figures[f"{name}_m64"] = _best_call(batched, products[:1], repeats)
    finally:
        torch.set_num_threads(previous)
    return GemmTimings(hidden=hidden, intermediate=columns, **figures)


def _torch_mm(weight: Any) -> Callable[[Any], Any]:
    import torch

    transposed = weight.t()
    return lambda x: torch.mm(x, transposed)


def _best_call(activations: Any, products: list[Callable[[Any], Any]], repeats: int) -> float:
    """The least seconds one product took, over `repeats` passes through `products`."""
    best = float("inf")
    for _ in range(repeats):
        for product in products:
            start = time.perf_counter()
            product(activations)
            best = min(best, time.perf_counter() - start)
    return best
