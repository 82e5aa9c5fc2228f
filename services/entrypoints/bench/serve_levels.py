"""Streaming a workload through an OpenAI server's `/v1/completions` at one concurrency level
(TTFT, ITL, E2E per request), and starting / stopping a `myvllm serve` to run it against. Used by
`bench serve` (services/entrypoints/bench/serve.py) and its multi-tenant workload (multi_tenant.py)."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from services.entrypoints.bench.sse_stream import stream_request
from services.entrypoints.bench.workload import BenchRequest


@dataclass
class ServeResult:
    """One concurrency level of one run."""

    name: str
    concurrency: int
    elapsed_s: float
    num_requests: int
    output_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def request_s(self) -> float:
        return self.num_requests / self.elapsed_s

    def pct(self, values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) * 1e3 if values else float("nan")

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "concurrency": self.concurrency, "elapsed_s": self.elapsed_s,
               "requests_per_s": self.request_s, "output_tok_s": self.output_tok_s}
        for label, values in (("ttft", self.ttft_s), ("itl", self.itl_s), ("e2e", self.e2e_s)):
            out[f"{label}_p50_ms"] = self.pct(values, 50)
            out[f"{label}_p99_ms"] = self.pct(values, 99)
        return out


async def _one(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest, result: ServeResult) -> None:
    timing = await stream_request(client, url, model, req)
    result.ttft_s.append(timing.ttft_s)
    result.e2e_s.append(timing.end_s - timing.start_s)
    if timing.time_per_output_token_s is not None:
        result.itl_s.append(timing.time_per_output_token_s)
    result.output_tokens += timing.num_tokens


async def run_level(base_url: str, requests: list[BenchRequest], concurrency: int,
                    name: str = "my-vllm serve") -> ServeResult:
    # A connection per request, for every peer alike: llama-server closes kept-alive connections on
    # its own terms, and a request sent on one it has just closed fails ("Server disconnected").
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        model = (await client.get(f"{base_url}/v1/models")).json()["data"][0]["id"]
        url = f"{base_url}/v1/completions"
        result = ServeResult(name, concurrency, 0.0, len(requests), 0)
        queue: asyncio.Queue[BenchRequest] = asyncio.Queue()
        for r in requests:
            queue.put_nowait(r)

        async def client_loop() -> None:
            while not queue.empty():
                await _one(client, url, model, queue.get_nowait(), result)

        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        result.elapsed_s = time.perf_counter() - start
        return result


def start_mesh(args: argparse.Namespace, extra: list[str] | tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """Start `myvllm serve` with the engine flags of `args` (plus `extra`), once it is ready."""
    from services.entrypoints.launcher import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "services.entrypoints.cli", "serve", "--port", str(port), "--dtype", args.dtype,
           "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.model:
        cmd += ["--model", args.model]
    if args.async_scheduling is not None:
        cmd.append("--async-scheduling" if args.async_scheduling else "--no-async-scheduling")
    if args.attention_backend:
        cmd += ["--attention-backend", args.attention_backend]
    if args.kv_cache_memory_bytes:
        cmd += ["--kv-cache-memory", str(args.kv_cache_memory_bytes)]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if args.data_parallel_size > 1:
        cmd += ["--data-parallel-size", str(args.data_parallel_size)]
    if args.enable_expert_parallel:
        cmd.append("--enable-expert-parallel")
    cmd += list(extra)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("Press Ctrl-C"):
            # The services write to the same pipe for the whole run: it must keep being read, or a
            # full pipe would block them mid-benchmark. (serve's --startup-timeout bounds the wait.)
            threading.Thread(target=_drain, args=(proc.stdout,), daemon=True).start()
            return proc, f"http://127.0.0.1:{port}"
    raise RuntimeError(f"myvllm serve failed to start (exit code {proc.wait()})")


def _drain(stream) -> None:
    for _ in stream:
        pass


def stop_mesh(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
