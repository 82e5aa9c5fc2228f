"""`myvllm bench serve`: online serving against the mesh, with latency percentiles.

Starts `myvllm serve` (worker, scheduler, gateway as processes) unless `--base-url` names
a running server, streams the random-token workload through `/v1/completions` at each
concurrency level, and reports request throughput, output tok/s and TTFT / ITL / E2E
p50 and p99. With `--vllm`, `vllm serve` (the peer venv of `make peer-vllm`, its threads bound
to the same cores) gets the same workload at the same levels. Then, in the same run and on the
same workload, the offline `LLM` (the mesh's cost is the gap between the two) and HF
transformers' static batch; a PNG plots throughput against latency over the sweep. The last
line is the ratio against vLLM (with --vllm), else against HF.

`--workload multi-tenant` instead compares the gateway's routing policies over data-parallel
replicas on tenants sharing system prompts (services/bench/multi_tenant.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from services.bench.workload import (
    BenchRequest,
    MyVllmPeer,
    PeerSpec,
    SamplingKnobs,
    format_table,
    log,
    model_vocab_size,
    random_requests,
    resolve_bench_dtype,
    run_peer,
    torch_threads,
    warmup_request,
    write_json,
)


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    from services.bench import multi_tenant
    from services.engine_args import add_engine_args

    p.add_argument("--base-url", default=None, help="a running server (default: start `myvllm serve` here)")
    p.add_argument("--workload", default="random", choices=["random", "multi-tenant"],
                   help="random prompts at each concurrency, or tenants sharing system prompts over replicas, "
                        "once per routing policy")
    multi_tenant.add_arguments(p)
    p.add_argument("--concurrency", default="16", help="concurrent clients; a comma list sweeps (e.g. 1,4,16)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len-min", type=int, default=32)
    p.add_argument("--input-len-max", type=int, default=256)
    p.add_argument("--output-len-min", type=int, default=32)
    p.add_argument("--output-len-max", type=int, default=128)
    p.add_argument("--plot", default="bench_serve.png", help="PNG of throughput against latency ('' = none)")
    p.add_argument("--no-offline", action="store_true", help="skip the in-process LLM on the same workload")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    p.add_argument("--vllm", action="store_true",
                   help="also serve the workload with `vllm serve` (the .venv-vllm of `make peer-vllm`)")
    p.add_argument("--json", metavar="PATH", default=None)
    add_engine_args(p)


async def _one(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest, result: ServeResult) -> None:
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"server answered {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    if tokens != req.output_len:
        raise RuntimeError(f"got {tokens} tokens for a request of {req.output_len}")
    result.ttft_s.append(first - start)
    result.e2e_s.append(end - start)
    if tokens > 1:
        result.itl_s.append((end - first) / (tokens - 1))
    result.output_tokens += tokens


async def _run_level(base_url: str, requests: list[BenchRequest], concurrency: int,
                     name: str = "my-vllm serve") -> ServeResult:
    limits = httpx.Limits(max_connections=concurrency + 4)
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


def _start_mesh(args: argparse.Namespace, extra: list[str] | tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`myvllm serve` with the engine flags of `args` (plus `extra`), once it is ready."""
    from services.launcher import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "serve", "--port", str(port), "--dtype", args.dtype,
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
    cmd += list(extra)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("Press Ctrl-C"):
            return proc, f"http://127.0.0.1:{port}"
    raise RuntimeError(f"myvllm serve failed to start (exit code {proc.wait()})")


def _stop_mesh(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _plot(results: list[ServeResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r.pct(r.e2e_s, 50) / 1e3 for r in results]
    ys = [r.output_tok_s for r in results]
    ax.plot(xs, ys, marker="o")
    for r, x, y in zip(results, xs, ys, strict=True):
        ax.annotate(f"c={r.concurrency}", (x, y), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("median end-to-end latency (s)")
    ax.set_ylabel("output tokens / s")
    ax.set_title("my-vllm serve: throughput vs latency")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from services.cli import engine_kwargs
    from services.common.config import default_model_path

    model_dir = args.model or default_model_path()
    args.dtype = resolve_bench_dtype(args.dtype)
    if args.workload == "multi-tenant":
        from services.bench import multi_tenant

        return multi_tenant.run(args, model_vocab_size(model_dir), warmup_request(model_vocab_size(model_dir),
                                                                                  args.seed))
    levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    requests = random_requests(args.num_prompts, args.input_len_min, args.input_len_max, args.output_len_min,
                               args.output_len_max, model_vocab_size(model_dir), args.seed)
    warmup = warmup_request(model_vocab_size(model_dir), args.seed)
    proc = None
    base_url = args.base_url
    if base_url is None:
        log("starting myvllm serve")
        proc, base_url = _start_mesh(args)
    results: list[ServeResult] = []
    try:
        asyncio.run(_run_level(base_url, [warmup], 1))
        for c in levels:
            log(f"serving {len(requests)} requests at concurrency {c}")
            results.append(asyncio.run(_run_level(base_url, requests, c)))
    finally:
        if proc is not None:
            _stop_mesh(proc)  # free the CPU for the in-process peers below
    vllm_results, vllm_error = _serve_vllm(args, model_dir, requests, warmup, levels) if args.vllm else ([], None)
    rows = [[f"{r.name} c={r.concurrency}", f"{r.request_s:.2f}", f"{r.output_tok_s:.1f}",
             f"{r.pct(r.ttft_s, 50):.0f}", f"{r.pct(r.ttft_s, 99):.0f}", f"{r.pct(r.itl_s, 50):.1f}",
             f"{r.pct(r.itl_s, 99):.1f}", f"{r.pct(r.e2e_s, 50):.0f}", f"{r.pct(r.e2e_s, 99):.0f}"]
            for r in results + vllm_results]
    knobs = SamplingKnobs()
    peers: dict[str, float] = {}
    total_out = sum(r.output_len for r in requests)
    compared = max(results, key=lambda r: r.concurrency)
    if not args.no_offline:
        # Same requests, same engine flags, and at most as many in flight as the mesh had: the
        # gap between the two is what the gRPC hops and the gateway cost.
        kwargs = dict(engine_kwargs(args), max_num_seqs=min(args.max_num_seqs, compared.concurrency))
        elapsed = run_peer(PeerSpec("my-vllm offline LLM", lambda: MyVllmPeer(kwargs)), warmup, knobs,
                           lambda peer: peer.generate(requests, knobs))
        peers[f"my-vllm offline LLM (max_num_seqs={kwargs['max_num_seqs']})"] = total_out / elapsed
    if not args.no_hf:
        from services.bench.hf_peer import HFPeer

        elapsed = run_peer(PeerSpec("hf transformers", lambda: HFPeer(model_dir, args.dtype, args.seed)),
                           warmup, knobs, lambda peer: peer.generate(requests, knobs))
        peers["hf transformers"] = total_out / elapsed
    for name, tok_s in peers.items():
        rows.append([name, "", f"{tok_s:.1f}", "", "", "", "", "", ""])
    print(f"workload: {len(requests)} requests, prompts {args.input_len_min}-{args.input_len_max} tokens, "
          f"outputs {args.output_len_min}-{args.output_len_max} tokens (ignore_eos, greedy), {total_out} output tokens")
    print(format_table(["run", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99", "ITL p50 ms", "ITL p99",
                        "E2E p50 ms", "E2E p99"], rows))
    if args.plot and results:
        _plot(results, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        write_json(args.json, {"levels": [r.to_dict() for r in results + vllm_results], "peers_output_tok_s": peers})
    for name, tok_s in peers.items():
        if name.startswith("my-vllm offline"):
            print(f"mesh c={compared.concurrency} / offline LLM (output tok/s): {compared.output_tok_s / tok_s:.2f}")
    if "hf transformers" in peers:
        print(f"ratio my-vllm / hf (output tok/s): {compared.output_tok_s / peers['hf transformers']:.2f}")
    for r in vllm_results:
        if r.concurrency == compared.concurrency:
            print(f"ratio my-vllm serve / vllm serve c={r.concurrency} (output tok/s): "
                  f"{compared.output_tok_s / r.output_tok_s:.2f}")
    if vllm_error is not None:
        print(f"vllm serve failed after {len(vllm_results)} of {len(levels)} levels: {vllm_error}")
        return 1
    return 0


def _serve_vllm(args: argparse.Namespace, model_dir: str, requests: list[BenchRequest], warmup: BenchRequest,
                levels: list[int]) -> tuple[list[ServeResult], str | None]:
    """vLLM's server on the same requests and levels, then stopped (before the in-process peers):
    the levels it completed, and its error if it failed (which must not lose the rows measured
    so far, ours or its own)."""
    from services.bench import vllm_peer
    from services.launcher import free_port
    from services.worker.model_runner import DEFAULT_CPU_KV_CACHE_BYTES

    results: list[ServeResult] = []
    proc = None
    try:
        proc, base_url, _ = vllm_peer.start_server(
            model_dir, args.dtype, torch_threads(), free_port(), args.seed, args.max_num_seqs,
            args.max_num_batched_tokens, args.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES)
        asyncio.run(_run_level(base_url, [warmup], 1, "vllm serve"))
        for c in levels:
            log(f"vllm serve: {len(requests)} requests at concurrency {c}")
            results.append(asyncio.run(_run_level(base_url, requests, c, "vllm serve")))
    except Exception as e:  # noqa: BLE001 - any failure of the peer is reported, not raised
        log(f"vllm serve failed: {type(e).__name__}: {e}")
        return results, f"{type(e).__name__}: {str(e).strip()[-2000:]}"
    finally:
        if proc is not None:
            _stop_mesh(proc)
    return results, None
