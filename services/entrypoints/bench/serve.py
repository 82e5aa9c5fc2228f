"""`myvllm bench serve`: online serving against the mesh, with latency percentiles.

Starts `myvllm serve` (worker, scheduler, gateway as processes) unless `--base-url` names
a running server, streams the random-token workload through `/v1/completions` at each
concurrency level, and reports request throughput, output tok/s and TTFT / ITL / E2E
p50 and p99. With `--vllm`, `vllm serve` (the peer venv of `make peer-vllm`, its threads bound
to the same cores) gets the same workload at the same levels; with `--llamacpp-server`, so does
llama.cpp's `llama-server` on the GGUF of the same weights, restarted with as many slots as
clients for each level (services/entrypoints/bench/llamacpp_server.py). Then, in the same run
and on the same workload, the offline `LLM` (the mesh's cost is the gap between the two) and HF
transformers' static batch; a PNG plots throughput against latency over the sweep. The ratios
against the server peers come last, after the HF one.

`--workload multi-tenant` instead compares the gateway's routing policies over data-parallel
replicas on tenants sharing system prompts (services/entrypoints/bench/multi_tenant.py); `--workload mixed`
compares colocated and prefill/decode-disaggregated deployments on long prompts arriving while
short streams decode (services/entrypoints/bench/mixed_workload.py).
"""

from __future__ import annotations

import argparse
import asyncio

from services.common.config import is_gguf_file
from services.entrypoints.bench.serve_levels import ServeResult, run_level, start_mesh, stop_mesh
from services.entrypoints.bench.workload import (
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    from services.entrypoints.bench import mixed_workload, multi_tenant
    from services.entrypoints.engine_args import add_engine_args

    p.add_argument("--base-url", default=None, help="a running server (default: start `myvllm serve` here)")
    p.add_argument("--workload", default="random", choices=["random", "multi-tenant", "mixed"],
                   help="random prompts at each concurrency; tenants sharing system prompts over replicas, "
                        "once per routing policy; or long prefills arriving while short streams decode, once per "
                        "deployment (colocated, prefill/decode disaggregated)")
    multi_tenant.add_arguments(p)
    mixed_workload.add_arguments(p)
    p.add_argument("--concurrency", default="16", help="concurrent clients; a comma list sweeps (e.g. 1,4,16)")
    p.add_argument("--num-prompts", type=int, default=64, help="number of requests")
    p.add_argument("--input-len-min", type=int, default=32, help="shortest prompt, tokens")
    p.add_argument("--input-len-max", type=int, default=256, help="longest prompt, tokens")
    p.add_argument("--output-len-min", type=int, default=32, help="shortest output, tokens")
    p.add_argument("--output-len-max", type=int, default=128, help="longest output, tokens")
    p.add_argument("--plot", default="bench_serve.png", help="PNG of throughput against latency ('' = none)")
    p.add_argument("--no-offline", action="store_true", help="skip the in-process LLM on the same workload")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    p.add_argument("--vllm", action="store_true",
                   help="also serve the workload with `vllm serve` (the .venv-vllm of `make peer-vllm`)")
    p.add_argument("--llamacpp-server", action="store_true",
                   help="also serve the workload with llama.cpp's llama-server (the .venv-llama of `make "
                        "peer-llama`) on the model's GGUF (--model FILE.gguf, or the Q4_1 file the default model "
                        "was converted from), restarted with -np CONCURRENCY slots for each level")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the figures to PATH as JSON")
    add_engine_args(p)


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


def _server_dtype(base_url: str) -> str | None:
    """The dtype a my-vllm server runs (its /metrics' myvllm:model_config_info); None when it
    does not say (another server, or no engine answering yet)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{base_url.rstrip('/').removesuffix('/v1')}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    for family in text_string_to_metric_families(text):
        if family.name == "myvllm:model_config_info":
            return next((sample.labels.get("dtype") or None for sample in family.samples), None)
    return None


def run(args: argparse.Namespace) -> int:
    from services.common.config import default_model_path
    from services.entrypoints.cli import engine_kwargs

    model_dir = args.model or default_model_path()
    # A running server: its dtype is what is measured (and what the peers here then run), not
    # what "auto" would pick on this machine.
    server_dtype = _server_dtype(args.base_url) if args.base_url and args.workload == "random" else None
    if server_dtype:
        log(f"the server at {args.base_url} runs dtype {server_dtype}")
        args.dtype = server_dtype
    else:
        args.dtype = resolve_bench_dtype(args.dtype, model_dir, args.quantization)
    if args.workload == "multi-tenant":
        from services.entrypoints.bench import multi_tenant

        return multi_tenant.run(args, model_vocab_size(model_dir), warmup_request(model_vocab_size(model_dir),
                                                                                  args.seed))
    if args.workload == "mixed":
        from services.entrypoints.bench import mixed_workload

        return mixed_workload.run(args, model_vocab_size(model_dir))
    levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    # Each level its own prompts (the same for every peer): a server that keeps a prefix cache
    # would otherwise answer the later levels from the first one's prompts, and one restarted per
    # level (llama-server) could not.
    per_level = [random_requests(args.num_prompts, args.input_len_min, args.input_len_max, args.output_len_min,
                                 args.output_len_max, model_vocab_size(model_dir), args.seed + i)
                 for i in range(len(levels))]
    warmup = warmup_request(model_vocab_size(model_dir), args.seed)
    proc = None
    base_url = args.base_url
    if base_url is None:
        log("starting myvllm serve")
        proc, base_url = start_mesh(args)
    results: list[ServeResult] = []
    try:
        asyncio.run(run_level(base_url, [warmup], 1))
        for c, level_requests in zip(levels, per_level, strict=True):
            log(f"serving {len(level_requests)} requests at concurrency {c}")
            results.append(asyncio.run(run_level(base_url, level_requests, c)))
    finally:
        if proc is not None:
            stop_mesh(proc)  # free the CPU for the in-process peers below
    vllm_results, vllm_error = _serve_vllm(args, model_dir, per_level, warmup, levels) if args.vllm else ([], None)
    llama_results, llama_error = (_serve_llama(args, model_dir, per_level, warmup, levels)
                                  if args.llamacpp_server else ([], None))
    peer_results = vllm_results + llama_results
    rows = [[f"{r.name} c={r.concurrency}", f"{r.request_s:.2f}", f"{r.output_tok_s:.1f}",
             f"{r.pct(r.ttft_s, 50):.0f}", f"{r.pct(r.ttft_s, 99):.0f}", f"{r.pct(r.itl_s, 50):.1f}",
             f"{r.pct(r.itl_s, 99):.1f}", f"{r.pct(r.e2e_s, 50):.0f}", f"{r.pct(r.e2e_s, 99):.0f}"]
            for r in results + peer_results]
    knobs = SamplingKnobs()
    peers: dict[str, float] = {}
    compared = max(results, key=lambda r: r.concurrency)
    requests = per_level[results.index(compared)]  # the offline peers run the most concurrent level's
    total_out = sum(r.output_len for r in requests)
    if not args.no_offline:
        # Same requests, same engine flags, and at most as many in flight as the mesh had: the
        # gap between the two is what the gRPC hops and the gateway cost.
        kwargs = dict(engine_kwargs(args), max_num_seqs=min(args.max_num_seqs, compared.concurrency))
        elapsed = run_peer(PeerSpec("my-vllm offline LLM", lambda: MyVllmPeer(kwargs)), warmup, knobs,
                           lambda peer: peer.generate(requests, knobs))
        peers[f"my-vllm offline LLM (max_num_seqs={kwargs['max_num_seqs']})"] = total_out / elapsed
    if not args.no_hf and is_gguf_file(model_dir):
        log("hf transformers skipped: it runs checkpoint directories, not a .gguf file")
    elif not args.no_hf:
        from services.entrypoints.bench.hf_peer import HFPeer

        elapsed = run_peer(PeerSpec("hf transformers", lambda: HFPeer(model_dir, args.dtype, args.seed)),
                           warmup, knobs, lambda peer: peer.generate(requests, knobs))
        peers["hf transformers"] = total_out / elapsed
    for name, tok_s in peers.items():
        rows.append([name, "", f"{tok_s:.1f}", "", "", "", "", "", ""])
    print(f"workload: {len(requests)} requests a level (each level its own prompts), prompts "
          f"{args.input_len_min}-{args.input_len_max} tokens, outputs {args.output_len_min}-{args.output_len_max} "
          f"tokens (ignore_eos, greedy), {total_out} output tokens at c={compared.concurrency}")
    print(format_table(["run", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99", "ITL p50 ms", "ITL p99",
                        "E2E p50 ms", "E2E p99"], rows))
    if args.plot and results:
        _plot(results, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        write_json(args.json, {"levels": [r.to_dict() for r in results + peer_results], "peers_output_tok_s": peers})
    for name, tok_s in peers.items():
        if name.startswith("my-vllm offline"):
            print(f"mesh c={compared.concurrency} / offline LLM (output tok/s): {compared.output_tok_s / tok_s:.2f}")
    if "hf transformers" in peers:
        print(f"ratio my-vllm / hf (output tok/s): {compared.output_tok_s / peers['hf transformers']:.2f}")
    for r in vllm_results:
        if r.concurrency == compared.concurrency:
            print(f"ratio my-vllm serve / vllm serve c={r.concurrency} (output tok/s): "
                  f"{compared.output_tok_s / r.output_tok_s:.2f}")
    for r in llama_results:
        if r.concurrency == compared.concurrency:
            print(f"ratio my-vllm serve / llama-server c={r.concurrency} (output tok/s): "
                  f"{compared.output_tok_s / r.output_tok_s:.2f}")
    failed = False
    if vllm_error is not None:
        print(f"vllm serve failed after {len(vllm_results)} of {len(levels)} levels: {vllm_error}")
        failed = True
    if llama_error is not None:
        print(f"llama-server failed after {len(llama_results)} of {len(levels)} levels: {llama_error}")
        failed = True
    return 1 if failed else 0


def _serve_vllm(args: argparse.Namespace, model_dir: str, per_level: list[list[BenchRequest]], warmup: BenchRequest,
                levels: list[int]) -> tuple[list[ServeResult], str | None]:
    """vLLM's server on the same levels and each level's requests, then stopped (before the
    in-process peers): the levels it completed, and its error if it failed (which must not lose
    the rows measured so far, ours or its own)."""
    from services.common.config import DEFAULT_CPU_KV_CACHE_BYTES
    from services.entrypoints.bench import vllm_peer
    from services.entrypoints.launcher import free_port

    results: list[ServeResult] = []
    proc = None
    try:
        proc, base_url, _ = vllm_peer.start_server(
            model_dir, args.dtype, torch_threads(), free_port(), args.seed, args.max_num_seqs,
            args.max_num_batched_tokens, args.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES)
        asyncio.run(run_level(base_url, [warmup], 1, "vllm serve"))
        for c, requests in zip(levels, per_level, strict=True):
            log(f"vllm serve: {len(requests)} requests at concurrency {c}")
            results.append(asyncio.run(run_level(base_url, requests, c, "vllm serve")))
    except Exception as e:  # noqa: BLE001 - any failure of the peer is reported, not raised
        log(f"vllm serve failed: {type(e).__name__}: {e}")
        return results, f"{type(e).__name__}: {str(e).strip()[-2000:]}"
    finally:
        if proc is not None:
            stop_mesh(proc)
    return results, None


def _serve_llama(args: argparse.Namespace, model_dir: str, per_level: list[list[BenchRequest]],
                 warmup: BenchRequest, levels: list[int]) -> tuple[list[ServeResult], str | None]:
    """llama-server on the GGUF of the same weights, started afresh for each level with as many
    slots as clients (each slot holds the longest request), same threads; the levels it
    completed, and its error if it failed."""
    from services.entrypoints.bench import llamacpp_server
    from services.entrypoints.launcher import free_port

    gguf = llamacpp_server.gguf_for(model_dir)
    if not llamacpp_server.available():
        return [], "no llama-server (run `make peer-llama`, or set MYVLLM_LLAMA_BIN_DIR)"
    if gguf is None:
        return [], f"no GGUF known for {model_dir} (pass --model FILE.gguf)"
    n_ctx = max(r.prompt_len + r.output_len for r in [*(r for level in per_level for r in level), warmup])
    results: list[ServeResult] = []
    for c, requests in zip(levels, per_level, strict=True):
        proc = None
        try:
            proc, base_url, _ = llamacpp_server.start_server(gguf, c, torch_threads(), n_ctx, free_port(), args.seed)
            asyncio.run(run_level(base_url, [warmup], 1, llamacpp_server.SERVE_NAME))
            log(f"llama-server -np {c}: {len(requests)} requests at concurrency {c}")
            results.append(asyncio.run(run_level(base_url, requests, c, llamacpp_server.SERVE_NAME)))
        except Exception as e:  # noqa: BLE001 - any failure of the peer is reported, not raised
            log(f"llama-server failed: {type(e).__name__}: {e}")
            return results, f"{type(e).__name__}: {str(e).strip()[-2000:]}"
        finally:
            if proc is not None:
                llamacpp_server.stop_server(proc)
    return results, None
