"""`myvllm bench latency`: batch-1 time to first token and inter-token latency per peer.

Per iteration: TTFT = one request with max_tokens=1; E2E = one request of `output_len`
tokens; ITL = (E2E - TTFT) / (output_len - 1). Every run uses a fresh prompt of
`input_len` tokens, so no peer gets a prefix-cache hit from an earlier iteration.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from services.common.bandwidth_floor import WeightFloor, streaming_buffer_bytes
from services.entrypoints.bench.workload import (
    SPEC_PEER,
    BenchRequest,
    Peer,
    PeerSpec,
    SamplingKnobs,
    format_table,
    log,
    run_peer,
    torch_threads,
)

RATIO_LABEL = "ratio hf / my-vllm (inter-token latency)"
LLAMA_SERVER_PEER = "llama.cpp server"
# Ratios against the rivals come before the HF one (which stays the report's last line).
RIVALS = ("llama.cpp", LLAMA_SERVER_PEER, "vllm")


@dataclass(frozen=True)
class LatencyResult:
    """One peer's per-iteration TTFT and E2E seconds."""

    peer: str
    input_len: int
    output_len: int
    ttft_s: list[float]
    e2e_s: list[float]
    threads: int

    @property
    def itl_s(self) -> list[float]:
        return [(e2e - ttft) / (self.output_len - 1) for ttft, e2e in zip(self.ttft_s, self.e2e_s, strict=True)]

    @property
    def mean_ttft_s(self) -> float:
        return statistics.fmean(self.ttft_s)

    @property
    def mean_e2e_s(self) -> float:
        return statistics.fmean(self.e2e_s)

    @property
    def mean_itl_s(self) -> float:
        return statistics.fmean(self.itl_s)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "itl_s": self.itl_s, "mean_ttft_s": self.mean_ttft_s,
                "mean_e2e_s": self.mean_e2e_s, "mean_itl_s": self.mean_itl_s}


def benchmark(prompts: Sequence[list[int]], output_len: int, num_iters: int, knobs: SamplingKnobs,
              peers: Sequence[PeerSpec], warmup: BenchRequest, interleave: bool = False) -> list[LatencyResult]:
    """Measure each peer with the same prompts: loaded one at a time, or, with `interleave`, the
    in-process ones loaded together and measured in turn, iteration by iteration (a subprocess
    peer, vLLM, still alone: its idle runtime may spin on the cores the others use).

    `prompts` holds 2 * num_iters prompts: iteration i uses prompts[2i] for TTFT and
    prompts[2i + 1] for E2E.
    """
    if output_len < 2:
        raise ValueError("inter-token latency needs output_len >= 2")
    if len(prompts) < 2 * num_iters:
        raise ValueError(f"need {2 * num_iters} prompts for {num_iters} iterations, got {len(prompts)}")

    def one_iteration(peer: Peer, i: int) -> tuple[float, float]:
        return (peer.generate([BenchRequest(prompts[2 * i], 1)], knobs),
                peer.generate([BenchRequest(prompts[2 * i + 1], output_len)], knobs))

    def measure(peer: Peer) -> LatencyResult:
        runs = [one_iteration(peer, i) for i in range(num_iters)]
        return LatencyResult(peer.name, len(prompts[0]), output_len, [r[0] for r in runs], [r[1] for r in runs],
                             torch_threads())

    together = [spec for spec in peers if spec.name not in SUBPROCESS_PEERS] if interleave else []
    results = {}
    if together:
        results = dict(zip([s.name for s in together], _interleaved(together, warmup, knobs, num_iters,
                                                                    one_iteration, len(prompts[0]), output_len),
                           strict=True))
    for spec in peers:
        if spec.name not in results:
            results[spec.name] = run_peer(spec, warmup, knobs, measure)
    return [results[spec.name] for spec in peers]


# Peers that run in a process of their own (their runtime's threads may spin while idle).
SUBPROCESS_PEERS = ("vllm", LLAMA_SERVER_PEER)


def _interleaved(specs: Sequence[PeerSpec], warmup: BenchRequest, knobs: SamplingKnobs, num_iters: int,
                 one_iteration: Callable[[Peer, int], tuple[float, float]], input_len: int,
                 output_len: int) -> list[LatencyResult]:
    loaded: list[Peer] = []
    try:
        for spec in specs:
            log(f"loading {spec.name}")
            loaded.append(spec.factory())
            loaded[-1].generate([warmup], knobs)
        runs: list[list[tuple[float, float]]] = [[] for _ in loaded]
        log("measuring " + ", ".join(s.name for s in specs) + " in turn")
        for i in range(num_iters):
            for peer, peer_runs in zip(loaded, runs, strict=True):
                peer_runs.append(one_iteration(peer, i))
        threads = torch_threads()
        return [LatencyResult(peer.name, input_len, output_len, [r[0] for r in peer_runs], [r[1] for r in peer_runs],
                              threads) for peer, peer_runs in zip(loaded, runs, strict=True)]
    finally:
        for peer in loaded:
            peer.close()
        del loaded
        gc.collect()


def ratio(results: Sequence[LatencyResult], other: str = "hf") -> float | None:
    """`other`'s mean inter-token latency over my-vllm's (>1: my-vllm is faster; None without both)."""
    by_name = {r.peer: r for r in results}
    if "my-vllm" not in by_name or other not in by_name:
        return None
    return by_name[other].mean_itl_s / by_name["my-vllm"].mean_itl_s


def spec_ratio(results: Sequence[LatencyResult]) -> float | None:
    """my-vllm's mean inter-token latency without speculation over with it (>1: speculation helps)."""
    by_name = {r.peer: r for r in results}
    if "my-vllm" not in by_name or SPEC_PEER not in by_name:
        return None
    return by_name["my-vllm"].mean_itl_s / by_name[SPEC_PEER].mean_itl_s


def report(results: Sequence[LatencyResult], floors: Mapping[str, WeightFloor] | None = None) -> str:
    """The table (means over iterations), each peer's bandwidth floor and efficiency (`floors`, by
    peer name), the ratios against llama.cpp and vLLM when they ran, then (when HF ran) the HF
    ratio as the last line."""
    header = ["peer", "input len", "output len", "iters", "TTFT ms", "E2E ms", "ITL ms", "decode tok/s", "threads"]
    rows = [[r.peer, r.input_len, r.output_len, len(r.ttft_s), f"{r.mean_ttft_s * 1e3:.1f}",
             f"{r.mean_e2e_s * 1e3:.1f}", f"{r.mean_itl_s * 1e3:.2f}",
             f"{1 / r.mean_itl_s:.1f}" if r.mean_itl_s > 0 else "n/a", r.threads]
            for r in results]
    text = format_table(header, rows)
    if floors:
        bandwidth = next(iter(floors.values())).bandwidth_bytes_s
        text += (f"\nbandwidth floor: streaming read {bandwidth / 1e9:.1f} GB/s (best of a few sums over "
                 f"{streaming_buffer_bytes() >> 30} GiB)")
        for r in results:
            if r.peer in floors:
                text += f"\n  {r.peer}: {floors[r.peer].describe(r.mean_itl_s)}"
    speculative = spec_ratio(results)
    if speculative is not None:
        text += f"\nratio my-vllm / {SPEC_PEER} (inter-token latency): {speculative:.2f}"
    for rival in RIVALS:
        rival_ratio = ratio(results, rival)
        if rival_ratio is not None:
            text += f"\nratio {rival} / my-vllm (inter-token latency): {rival_ratio:.2f}"
    value = ratio(results)
    if value is not None:
        text += f"\n{RATIO_LABEL}: {value:.2f}"
    return text


def weight_floors(peers: Sequence[str], model: str, dtype_bytes: int, gguf: str | None,
                  bandwidth_bytes_s: float) -> dict[str, WeightFloor]:
    """Each peer's floor: the llama.cpp server reads `gguf`'s stored (quantized) weights, every
    other peer `model`'s at `dtype_bytes` per element (a .gguf model at its stored sizes)."""
    from services.common.bandwidth_floor import gguf_weight_bytes, weight_bytes_per_token

    model_bytes = weight_bytes_per_token(model, dtype_bytes)
    floors = {}
    for peer in peers:
        weights = gguf_weight_bytes(gguf) if peer == LLAMA_SERVER_PEER and gguf else model_bytes
        floors[peer] = WeightFloor(weights, bandwidth_bytes_s)
    return floors
