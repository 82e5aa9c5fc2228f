"""`myvllm bench serve --workload mixed`: long prefills arriving while short streams decode.

The workload of prefill/decode disaggregation (issue #27): `--short-streams` clients each loop
short requests (prompts of `--short-input-len-min`..`--short-input-len-max` random tokens,
`--short-output-len` tokens back) for the whole run, while `--long-prompts` long requests
(`--long-input-len-min`..`--long-input-len-max` random tokens, only `--long-output-len` tokens
back) arrive one every `--long-interval-s` seconds, the first one interval after the short
streams start. The short streams stop starting new requests once every long request has
finished; the run ends when their last requests do.

On a colocated deployment a long prompt's prefill shares the steps of the replica it lands on
with the decodes there, so those streams stall (their inter-token latency jumps); with P/D
disaggregation the prefill runs on its own replica and the decode replica only ever decodes.
Every deployment of `--mixed-deployments` (`DEPLOYMENTS`: a name and the extra
`myvllm serve` flags, all with the same number of replicas) gets the same requests on the same
schedule, each on a fresh `myvllm serve`, through streaming `/v1/completions` (greedy,
`ignore_eos`, so every output has exactly its requested length). The table shows, per
deployment: the short requests' TTFT and ITL p50/p99 (ITL per token: the time between two
consecutive streamed chunks that carry tokens, split evenly over the tokens of the later one),
the long requests' TTFT p50/p99, and the output tok/s of the whole run (short and long). A
deployment that fails to start (or to serve) is a failed row; the others still run.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from services.entrypoints.bench.serve_levels import run_level, start_mesh, stop_mesh
from services.entrypoints.bench.sse_stream import StreamTiming, stream_request
from services.entrypoints.bench.workload import (
    SAFE_TOKEN_ID_MIN,
    BenchRequest,
    format_table,
    log,
    random_requests,
    write_json,
)

# The deployments compared, all of two replicas: (name, extra `myvllm serve` flags).
DEPLOYMENTS: list[tuple[str, tuple[str, ...]]] = [
    ("colocated", ("--data-parallel-size", "2")),
    ("pd", ("--prefill-replicas", "1", "--decode-replicas", "1")),
    ("pd-grpc", ("--prefill-replicas", "1", "--decode-replicas", "1", "--kv-transfer-config",
                 '{"kv_connector": "GrpcConnector"}')),
]

_STREAM_LONG = 0  # the rng stream of the long prompts; short prompts draw from (1, stream, index)
_STREAM_SHORT = 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--workload mixed (long prefills arriving while short streams decode)")
    g.add_argument("--short-streams", type=int, default=8, help="clients each looping short requests for the run")
    g.add_argument("--short-input-len-min", type=int, default=32, help="shortest short prompt, tokens")
    g.add_argument("--short-input-len-max", type=int, default=128, help="longest short prompt, tokens")
    g.add_argument("--short-output-len", type=int, default=128, help="tokens generated per short request")
    g.add_argument("--long-prompts", type=int, default=8, help="long requests, one every --long-interval-s")
    g.add_argument("--long-input-len-min", type=int, default=1024,
                   help="default 1024-2048 tokens, sized for a CPU (2 cores, SmolLM2-135M: both deployments in about "
                        "2.5 min, starts included; 2048-4096 took about 110 s a deployment, the long prompts "
                        "queueing behind each other); on a GPU take 2048-4096 or more")
    g.add_argument("--long-input-len-max", type=int, default=2048, help="longest long prompt, tokens")
    g.add_argument("--long-output-len", type=int, default=16, help="tokens generated per long request")
    g.add_argument("--long-interval-s", type=float, default=2.0,
                   help="seconds between two long arrivals (the first one this long after the short streams start)")
    g.add_argument("--mixed-deployments", default=",".join(name for name, _ in DEPLOYMENTS),
                   help="the deployments to compare, each on a fresh `myvllm serve` of 2 replicas: "
                        + "; ".join(f"{name}: {' '.join(flags)}" for name, flags in DEPLOYMENTS))


# --------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class MixedWorkload:
    """The long requests with their arrival times, and the recipe of the short ones (drawn on
    demand: a short stream runs as many as the run lasts for)."""

    long_requests: list[BenchRequest]
    long_arrivals_s: list[float]  # seconds after the short streams start
    short_input_len_min: int
    short_input_len_max: int
    short_output_len: int
    vocab_size: int
    seed: int

    def short_request(self, stream: int, index: int) -> BenchRequest:
        """Short request `index` of short stream `stream`: the same for the same (seed, stream, index)."""
        rng = np.random.default_rng([self.seed, 27, _STREAM_SHORT, stream, index])
        n = int(rng.integers(self.short_input_len_min, self.short_input_len_max + 1))
        return BenchRequest(rng.integers(SAFE_TOKEN_ID_MIN, self.vocab_size - 1, size=n).tolist(),
                            self.short_output_len)

    def describe(self, short_streams: int) -> str:
        return (f"workload: mixed, {short_streams} short streams (prompts {self.short_input_len_min}-"
                f"{self.short_input_len_max} tokens, {self.short_output_len} output tokens) while "
                f"{len(self.long_requests)} long prompts ({min(r.prompt_len for r in self.long_requests)}-"
                f"{max(r.prompt_len for r in self.long_requests)} tokens, {self.long_requests[0].output_len} output "
                f"tokens) arrive every {_interval(self.long_arrivals_s):g} s (greedy, ignore_eos)")

    def to_dict(self, short_streams: int) -> dict[str, Any]:
        return {"short_streams": short_streams, "short_input_len": [self.short_input_len_min, self.short_input_len_max],
                "short_output_len": self.short_output_len,
                "long_prompt_lens": [r.prompt_len for r in self.long_requests],
                "long_output_len": self.long_requests[0].output_len, "long_arrivals_s": self.long_arrivals_s,
                "seed": self.seed}


def _interval(arrivals: Sequence[float]) -> float:
    return arrivals[0] if len(arrivals) < 2 else arrivals[1] - arrivals[0]


def mixed_workload(long_prompts: int, long_input_len_min: int, long_input_len_max: int, long_output_len: int,
                   long_interval_s: float, short_input_len_min: int, short_input_len_max: int,
                   short_output_len: int, vocab_size: int, seed: int) -> MixedWorkload:
    """The mixed workload: `long_prompts` long requests arriving at interval, 2 x interval, ...
    (seconds after the short streams start), and short requests drawn per (stream, index)."""
    if long_interval_s <= 0:
        raise ValueError(f"--long-interval-s must be positive, got {long_interval_s}")
    if not 1 <= short_input_len_min <= short_input_len_max or short_output_len < 1:
        raise ValueError("need 1 <= --short-input-len-min <= --short-input-len-max and --short-output-len >= 1")
    # random_requests checks the long sizes (and the vocabulary) and draws them from a stream of their own.
    longs = random_requests(long_prompts, long_input_len_min, long_input_len_max, long_output_len, long_output_len,
                            vocab_size, seed, stream=2700 + _STREAM_LONG)
    return MixedWorkload(longs, [(i + 1) * long_interval_s for i in range(long_prompts)], short_input_len_min,
                         short_input_len_max, short_output_len, vocab_size, seed)


def select_deployments(names: str,
                       deployments: Sequence[tuple[str, tuple[str, ...]]] = tuple(DEPLOYMENTS),
                       ) -> list[tuple[str, tuple[str, ...]]]:
    """The deployments named in a comma list, in the list's order."""
    known = dict(deployments)
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in known]
    if unknown or not chosen:
        raise ValueError(f"--mixed-deployments: unknown {unknown or 'empty list'}; choose from {', '.join(known)}")
    return [(n, known[n]) for n in chosen]


# --------------------------------------------------------------------------- timings and figures


def pct_ms(values: Sequence[float], q: float) -> float:
    """The q-th percentile of seconds, in milliseconds (nan for no values)."""
    return float(np.percentile(values, q)) * 1e3 if len(values) else float("nan")


@dataclass
class MixedResult:
    """One deployment's run (or why it has none)."""

    deployment: str
    serve_args: tuple[str, ...]
    elapsed_s: float = 0.0
    output_tokens: int = 0
    short_requests: int = 0
    long_requests: int = 0
    short_ttft_s: list[float] = field(default_factory=list)
    short_itl_s: list[float] = field(default_factory=list)
    long_ttft_s: list[float] = field(default_factory=list)
    error: str | None = None

    def add(self, timing: StreamTiming, long: bool) -> None:
        self.output_tokens += timing.num_tokens
        if long:
            self.long_requests += 1
            self.long_ttft_s.append(timing.ttft_s)
        else:
            self.short_requests += 1
            self.short_ttft_s.append(timing.ttft_s)
            self.short_itl_s.extend(timing.itl_s)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"serve_args": list(self.serve_args), "error": self.error, "elapsed_s": self.elapsed_s,
                               "output_tokens": self.output_tokens, "output_tok_s": self.output_tok_s,
                               "short_requests": self.short_requests, "long_requests": self.long_requests}
        for label, values in (("short_ttft", self.short_ttft_s), ("short_itl", self.short_itl_s),
                              ("long_ttft", self.long_ttft_s)):
            out[f"{label}_p50_ms"] = pct_ms(values, 50)
            out[f"{label}_p99_ms"] = pct_ms(values, 99)
        return out


TABLE_HEADER = ["deployment", "short reqs", "short TTFT p50 ms", "p99", "short ITL p50 ms", "p99",
                "long TTFT p50 ms", "p99", "out tok/s", "status"]


def format_report(results: Sequence[MixedResult]) -> str:
    """One row per deployment; a failed one shows only its status."""
    rows = []
    for r in results:
        if r.error is not None:
            rows.append([r.deployment] + ["-"] * (len(TABLE_HEADER) - 2) + ["failed"])
            continue
        rows.append([r.deployment, r.short_requests, f"{pct_ms(r.short_ttft_s, 50):.0f}",
                     f"{pct_ms(r.short_ttft_s, 99):.0f}", f"{pct_ms(r.short_itl_s, 50):.1f}",
                     f"{pct_ms(r.short_itl_s, 99):.1f}", f"{pct_ms(r.long_ttft_s, 50):.0f}",
                     f"{pct_ms(r.long_ttft_s, 99):.0f}", f"{r.output_tok_s:.1f}", "ok"])
    return format_table(TABLE_HEADER, rows)


def report_json(workload: MixedWorkload, short_streams: int, results: Sequence[MixedResult]) -> dict[str, Any]:
    return {"mixed": {"workload": workload.to_dict(short_streams),
                      "deployments": {r.deployment: r.to_dict() for r in results}}}


# --------------------------------------------------------------------------- driving one deployment


async def drive(base_url: str, workload: MixedWorkload, short_streams: int, result: MixedResult) -> None:
    """Run the workload once against `base_url`, into `result`."""
    num_long = len(workload.long_requests)
    limits = httpx.Limits(max_connections=short_streams + num_long + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        model = (await client.get(f"{base_url}/v1/models")).json()["data"][0]["id"]
        url = f"{base_url}/v1/completions"
        longs_done = asyncio.Event()
        remaining = [num_long]
        t0 = time.perf_counter()

        async def short_loop(stream: int) -> None:
            index = 0
            while not longs_done.is_set():
                result.add(await stream_request(client, url, model, workload.short_request(stream, index)), False)
                index += 1

        async def long_one(req: BenchRequest, arrival_s: float) -> None:
            await asyncio.sleep(max(0.0, t0 + arrival_s - time.perf_counter()))
            result.add(await stream_request(client, url, model, req), True)
            remaining[0] -= 1
            if remaining[0] == 0:
                longs_done.set()

        if num_long == 0:
            longs_done.set()
        async with asyncio.TaskGroup() as tg:  # one failure cancels the rest
            for s in range(short_streams):
                tg.create_task(short_loop(s))
            for req, arrival in zip(workload.long_requests, workload.long_arrivals_s, strict=True):
                tg.create_task(long_one(req, arrival))
        result.elapsed_s = time.perf_counter() - t0


def _error(stage: str, e: BaseException) -> str:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return f"{stage}: {type(e).__name__}: {str(e).strip()[-1000:]}"


def run_deployments(args: argparse.Namespace, deployments: Sequence[tuple[str, tuple[str, ...]]],
                    workload: MixedWorkload, warmups: list[BenchRequest]) -> list[MixedResult]:
    """Each deployment on a fresh `myvllm serve` (the engine flags of `args` plus its own): warm
    up, run the workload, stop. One that fails to start or to serve is recorded as failed."""
    mesh_args = argparse.Namespace(**{**vars(args), "data_parallel_size": 1})  # the deployment sets the replicas
    results = []
    for name, extra in deployments:
        result = MixedResult(name, tuple(extra))
        results.append(result)
        log(f"{name}: starting myvllm serve {' '.join(extra)}")
        try:
            proc, base_url = start_mesh(mesh_args, list(extra))
        except Exception as e:  # noqa: BLE001 - a deployment that cannot start is a failed row, not a crash
            result.error = _error("start", e)
            log(f"{name}: failed: {result.error}")
            continue
        try:
            asyncio.run(run_level(base_url, warmups, len(warmups), name))
            log(f"{name}: {args.short_streams} short streams, {len(workload.long_requests)} long prompts")
            asyncio.run(drive(base_url, workload, args.short_streams, result))
        except Exception as e:  # noqa: BLE001 - nor is one that fails while serving
            result.error = _error("run", e)
            log(f"{name}: failed: {result.error}")
        finally:
            stop_mesh(proc)
    return results


def run(args: argparse.Namespace, vocab_size: int) -> int:
    if args.base_url:
        raise ValueError("--workload mixed starts its own deployments (one per --mixed-deployments): drop --base-url")
    if args.data_parallel_size != 1:
        raise ValueError("--workload mixed: each deployment sets its own replicas (2); drop --data-parallel-size")
    if args.short_streams < 1:
        raise ValueError(f"--short-streams must be at least 1, got {args.short_streams}")
    deployments = select_deployments(args.mixed_deployments)
    workload = mixed_workload(args.long_prompts, args.long_input_len_min, args.long_input_len_max,
                              args.long_output_len, args.long_interval_s, args.short_input_len_min,
                              args.short_input_len_max, args.short_output_len, vocab_size, args.seed)
    # Two distinct tiny prompts, in flight together: with two replicas both are likely warmed up.
    warmups = random_requests(2, 8, 8, 4, 4, vocab_size, args.seed, stream=2799)
    start = time.perf_counter()
    results = run_deployments(args, deployments, workload, warmups)
    print(workload.describe(args.short_streams))
    print(format_report(results))
    for r in results:
        if r.error is not None:
            print(f"{r.deployment} failed: {r.error}")
    print(f"wall time: {time.perf_counter() - start:.0f} s")
    if args.json:
        write_json(args.json, report_json(workload, args.short_streams, results))
    return 1 if any(r.error is not None for r in results) else 0
