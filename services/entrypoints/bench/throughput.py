"""`myvllm bench throughput`: one fixed offline workload through each peer in turn.

Each peer is timed from its first generate call of the workload to the end (loading and
a tiny warm-up excluded). Output tokens are the requested ones (the useful tokens), the
same count for every peer; a static batch's extra tokens past a request's length are waste.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from services.entrypoints.bench.workload import (
    SPEC_PEER,
    BenchRequest,
    Peer,
    PeerSpec,
    SamplingKnobs,
    format_table,
    run_peer,
    torch_threads,
)

RATIO_LABEL = "ratio my-vllm / hf (output tok/s)"
# Ratios against the rivals come before the HF one (which stays the report's last line).
RIVALS = ("llama.cpp", "vllm")
# The peer name of `--json-schema`'s run: my-vllm with every request constrained to the schema.
STRUCTURED = "my-vllm json-schema"
LORA = "my-vllm+lora"  # --lora-adapters: every request with one of N adapters
STRUCTURED_LABEL = "ratio my-vllm json-schema / my-vllm (output tok/s)"


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

    def measure(spec: PeerSpec, peer: Peer) -> ThroughputResult:
        threads = torch_threads()
        elapsed = peer.generate(requests, knobs)
        # A constrained run may end outputs early (complete JSON): it counts what it generated.
        generated = getattr(peer, "num_output_tokens", None) or output_tokens
        return ThroughputResult(spec.name, len(requests), prompt_tokens, generated, elapsed, threads)

    return [run_peer(spec, warmup, knobs, functools.partial(measure, spec)) for spec in peers]


def ratio(results: Sequence[ThroughputResult], other: str = "hf") -> float | None:
    """my-vllm's output tok/s over `other`'s (None without both)."""
    by_name = {r.peer: r for r in results}
    if "my-vllm" not in by_name or other not in by_name:
        return None
    return by_name["my-vllm"].output_tok_s / by_name[other].output_tok_s


def lora_ratio(results: Sequence[ThroughputResult]) -> float | None:
    """The run with LoRA adapters' output tok/s over the base model's (None without both)."""
    by_name = {r.peer: r for r in results}
    if LORA not in by_name or "my-vllm" not in by_name:
        return None
    return by_name[LORA].output_tok_s / by_name["my-vllm"].output_tok_s


def structured_ratio(results: Sequence[ThroughputResult]) -> float | None:
    """The constrained run's output tok/s over the unconstrained one's (None without both)."""
    by_name = {r.peer: r for r in results}
    if STRUCTURED not in by_name or "my-vllm" not in by_name:
        return None
    return by_name[STRUCTURED].output_tok_s / by_name["my-vllm"].output_tok_s


def spec_ratio(results: Sequence[ThroughputResult]) -> float | None:
    """my-vllm's output tok/s with --speculative-config over without (None without both)."""
    by_name = {r.peer: r for r in results}
    if SPEC_PEER not in by_name or "my-vllm" not in by_name:
        return None
    return by_name[SPEC_PEER].output_tok_s / by_name["my-vllm"].output_tok_s


def report(results: Sequence[ThroughputResult]) -> str:
    """The table, the ratios against llama.cpp and vLLM when they ran, then (when HF ran) the HF
    ratio as the last line."""
    header = ["peer", "requests", "prompt tokens", "output tokens", "elapsed s", "output tok/s", "total tok/s",
              "threads"]
    rows = [[r.peer, r.num_requests, r.prompt_tokens, r.output_tokens, f"{r.elapsed_s:.2f}", f"{r.output_tok_s:.1f}",
             f"{r.total_tok_s:.1f}", r.threads] for r in results]
    text = format_table(header, rows)
    lora = lora_ratio(results)
    if lora is not None:
        text += f"\nratio {LORA} / my-vllm (output tok/s): {lora:.2f}"
    structured = structured_ratio(results)
    if structured is not None:
        text += f"\n{STRUCTURED_LABEL}: {structured:.2f}"
    speculative = spec_ratio(results)
    if speculative is not None:
        text += f"\nratio {SPEC_PEER} / my-vllm (output tok/s): {speculative:.2f}"
    for rival in RIVALS:
        rival_ratio = ratio(results, rival)
        if rival_ratio is not None:
            text += f"\nratio my-vllm / {rival} (output tok/s): {rival_ratio:.2f}"
    value = ratio(results)
    if value is not None:
        text += f"\n{RATIO_LABEL}: {value:.2f}"
    return text
