"""`myvllm bench roofline`: this machine's limits and the engine's efficiency against them.

Limits: the streaming read bandwidth (services/common/bandwidth_floor.py) and the best GEMM
rate per dtype, each with 1 thread and with torch's thread count. Engine, per dtype:

- batch-1 decode: every weight is read once per token, so weight bytes / bandwidth is the
  floor of the inter-token latency, and floor / ITL its efficiency (1 = at the memory limit);
- a batched decode step (64 running requests by default): its FLOPs (2 x parameters x requests
  for the projections, plus attention's 4 x layers x heads x head_dim x context per request)
  over its time, as a fraction of the GEMM peak (1 = at the compute limit).

This module holds the figures, their arithmetic and the table; roofline_measure.py measures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from services.entrypoints.bench.workload import format_table

PARTS = ("bandwidth", "gemm", "latency", "batch")


@dataclass(frozen=True)
class ModelShape:
    """What a decode step's FLOPs depend on: the parameters every token multiplies (the
    projections and the LM head) and the attention's size."""

    params: int
    layers: int
    heads: int
    head_dim: int


def decode_step_flops(shape: ModelShape, requests: int, context: float) -> float:
    """FLOPs of one decode step of `requests` sequences, each attending over `context` tokens:
    a multiply-add per parameter per token, and QK^T plus PV (2 x heads x head_dim multiply-adds
    per context token) in every layer."""
    projections = 2.0 * shape.params * requests
    attention = 4.0 * shape.layers * shape.heads * shape.head_dim * context * requests
    return projections + attention


@dataclass(frozen=True)
class MachineLimits:
    """Bytes/s of a streaming read by thread count; best GEMM FLOP/s by dtype, then thread count."""

    bandwidth_bytes_s: Mapping[int, float]
    gemm_flops_s: Mapping[str, Mapping[int, float]]


@dataclass(frozen=True)
class EngineFigures:
    """One dtype's engine measurements (None: that part was skipped)."""

    dtype: str
    threads: int
    weight_bytes: int
    itl_s: float | None = None
    batch: int = 0
    step_s: float | None = None
    step_flops: float | None = None


@dataclass(frozen=True)
class EngineEfficiency:
    """An `EngineFigures` held against the machine's limits at its thread count."""

    figures: EngineFigures
    floor_s: float | None
    efficiency: float | None
    step_flops_s: float | None
    fraction_of_gemm_peak: float | None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self.figures), "floor_s": self.floor_s, "efficiency": self.efficiency,
                "step_flops_s": self.step_flops_s, "fraction_of_gemm_peak": self.fraction_of_gemm_peak}


def engine_efficiency(figures: EngineFigures, limits: MachineLimits) -> EngineEfficiency:
    """floor = weight bytes / bandwidth, efficiency = floor / ITL; step FLOP/s = FLOPs / step
    time, as a fraction of the dtype's GEMM peak. A figure whose inputs are missing is None."""
    bandwidth = limits.bandwidth_bytes_s.get(figures.threads)
    floor = figures.weight_bytes / bandwidth if bandwidth else None
    efficiency = floor / figures.itl_s if floor is not None and figures.itl_s else None
    flops_s = figures.step_flops / figures.step_s if figures.step_flops and figures.step_s else None
    peak = limits.gemm_flops_s.get(figures.dtype, {}).get(figures.threads)
    fraction = flops_s / peak if flops_s is not None and peak else None
    return EngineEfficiency(figures, floor, efficiency, flops_s, fraction)


def report(limits: MachineLimits, engine: Sequence[EngineEfficiency], dtypes: Sequence[str]) -> str:
    """One table: a row per figure and thread count, a column per dtype ("n/a": not measured;
    the bandwidth, a property of the machine, stands in every dtype's column)."""
    header = ["figure", "threads", *dtypes]
    rows: list[list[Any]] = []
    for threads, bandwidth in sorted(limits.bandwidth_bytes_s.items()):
        rows.append(["read bandwidth GB/s", threads, *[f"{bandwidth / 1e9:.1f}"] * len(dtypes)])
    gemm_threads = sorted({t for by_threads in limits.gemm_flops_s.values() for t in by_threads})
    for threads in gemm_threads:
        rows.append(["GEMM peak GFLOP/s", threads,
                     *[_number(limits.gemm_flops_s.get(d, {}).get(threads), 1e-9, 1) for d in dtypes]])
    by_dtype = {e.figures.dtype: e for e in engine}
    if by_dtype:
        threads = next(iter(by_dtype.values())).figures.threads
        batch = next((e.figures.batch for e in engine if e.figures.batch), 0)

        def row(label: str, value: str, scale: float, digits: int) -> list[Any]:
            cells = [_number(getattr(by_dtype[d], value, None) if d in by_dtype else None, scale, digits)
                     for d in dtypes]
            return [label, threads, *cells]

        def figure(label: str, value: str, scale: float, digits: int) -> list[Any]:
            cells = [_number(getattr(by_dtype[d].figures, value) if d in by_dtype else None, scale, digits)
                     for d in dtypes]
            return [label, threads, *cells]

        rows += [figure("weights MB per token", "weight_bytes", 1e-6, 1),
                 figure("batch-1 ITL ms", "itl_s", 1e3, 2),
                 row("batch-1 floor ms (weights / bandwidth)", "floor_s", 1e3, 2),
                 row("batch-1 efficiency (floor / ITL)", "efficiency", 1, 2)]
        if batch:
            rows += [figure(f"{batch}-request decode step ms", "step_s", 1e3, 2),
                     figure(f"{batch}-request step GFLOP", "step_flops", 1e-9, 2),
                     row(f"{batch}-request GFLOP/s", "step_flops_s", 1e-9, 1),
                     row(f"{batch}-request % of GEMM peak", "fraction_of_gemm_peak", 100, 1)]
    return format_table(header, rows)


def _number(value: float | None, scale: float, digits: int) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def to_json(limits: MachineLimits, engine: Sequence[EngineEfficiency]) -> dict[str, Any]:
    """The figures for --json (thread counts as strings: JSON keys)."""
    return {"read_bandwidth_bytes_s": {str(t): v for t, v in sorted(limits.bandwidth_bytes_s.items())},
            "gemm_peak_flops_s": {d: {str(t): v for t, v in sorted(by.items())}
                                  for d, by in limits.gemm_flops_s.items()},
            "engine": [e.to_dict() for e in engine]}
