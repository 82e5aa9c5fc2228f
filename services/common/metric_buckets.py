"""Histogram bucket bounds as vLLM's metrics use them, written once for the engine (which counts
some histograms itself and ships the counts in `Stats`) and the gateway (which serves them)."""

from __future__ import annotations

import bisect

# Tokens per engine step (vllm:iteration_tokens_total).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class BucketCounts:
    """Observations counted per bucket (not cumulative; the last slot: above every bound)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
