"""`myvllm bench throughput`: one fixed offline workload through each peer in turn.

Each peer is timed from its first generate call of the workload to the end (loading and
a tiny warm-up excluded). Output tokens are the requested ones (the useful tokens), the
same count for every peer; a static batch's extra tokens past a request's length are waste.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from services.bench.workload import BenchRequest, Peer, PeerSpec, SamplingKnobs, format_table, run_peer, torch_threads

RATIO_LABEL = "ratio my-vllm / hf (output tok/s)"


@dataclass(frozen=True)
class ThroughputResult:
    """One peer's figures for the whole workload."""

    peer: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    threads: int

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "output_tok_s": self.output_tok_s, "total_tok_s": self.total_tok_s}


def benchmark(requests: Sequence[BenchRequest], knobs: SamplingKnobs, peers: Sequence[PeerSpec],
              warmup: BenchRequest) -> list[ThroughputResult]:
    """Run the workload through each peer (loaded one at a time) and return their figures."""
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(r.output_len for r in requests)

    def measure(peer: Peer) -> ThroughputResult:
        threads = torch_threads()
        elapsed = peer.generate(requests, knobs)
        return ThroughputResult(peer.name, len(requests), prompt_tokens, output_tokens, elapsed, threads)

    return [run_peer(spec, warmup, knobs, measure) for spec in peers]


def ratio(results: Sequence[ThroughputResult]) -> float | None:
    """my-vllm's output tok/s over HF's (None without both)."""
    by_name = {r.peer: r for r in results}
    if "my-vllm" not in by_name or "hf" not in by_name:
        return None
    return by_name["my-vllm"].output_tok_s / by_name["hf"].output_tok_s


def report(results: Sequence[ThroughputResult]) -> str:
    """The table, then (when HF ran) the ratio as the last line."""
    header = ["peer", "requests", "prompt tokens", "output tokens", "elapsed s", "output tok/s", "total tok/s",
              "threads"]
    rows = [[r.peer, r.num_requests, r.prompt_tokens, r.output_tokens, f"{r.elapsed_s:.2f}", f"{r.output_tok_s:.1f}",
             f"{r.total_tok_s:.1f}", r.threads] for r in results]
    text = format_table(header, rows)
    value = ratio(results)
    if value is not None:
        text += f"\n{RATIO_LABEL}: {value:.2f}"
    return text
