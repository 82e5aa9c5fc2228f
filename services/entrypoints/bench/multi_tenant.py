"""`myvllm bench serve --workload multi-tenant`: routing policies compared on shared prefixes.

`--tenants` tenants each have their own system prompt of `--system-prompt-len` random
tokens; each of `--users-per-tenant` users per tenant asks one short distinct question
(`--question-len` random tokens) and gets `--tenant-output-len` tokens back. Arrivals are
interleaved (the first user of every tenant, then the second of every tenant, ..., each round
in a random order), with
`--concurrency` clients in flight. For each policy of `--routing-policies` the same
requests go to a fresh `myvllm serve --data-parallel-size D --routing POLICY` (fresh, so no
policy starts with another's cache), and the table shows the prefix-cache hit rate (prompt
tokens served from cache over prompt tokens looked up, summed over the replicas), TTFT
p50/p99 and output tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import re

import httpx
import numpy as np

from services.entrypoints.bench.serve_levels import run_level, start_mesh, stop_mesh
from services.entrypoints.bench.workload import SAFE_TOKEN_ID_MIN, BenchRequest, format_table, log, write_json

# Replicas per deployment when --data-parallel-size is left at its engine default of 1.
DEFAULT_REPLICAS = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tenants", type=int, default=16, help="--workload multi-tenant: tenants (one system prompt each)")
    p.add_argument("--users-per-tenant", type=int, default=8, help="--workload multi-tenant: users of each tenant")
    p.add_argument("--system-prompt-len", type=int, default=1000, help="tokens of each tenant's system prompt")
    p.add_argument("--question-len", type=int, default=16, help="tokens of each user's question")
    p.add_argument("--tenant-output-len", type=int, default=8, help="tokens generated per request")
    p.add_argument("--routing-policies", default="cache-aware,load,round-robin",
                   help="the gateway --routing values to compare, each on a fresh deployment of "
                        f"--data-parallel-size replicas ({DEFAULT_REPLICAS} when not given)")


def tenant_requests(num_tenants: int, users_per_tenant: int, system_len: int, question_len: int, output_len: int,
                    vocab_size: int, seed: int) -> list[BenchRequest]:
    """The multi-tenant workload, user-major (tenants interleaved, each round shuffled)."""
    if min(num_tenants, users_per_tenant, system_len, question_len, output_len) < 1:
        raise ValueError("--tenants, --users-per-tenant, --system-prompt-len, --question-len and "
                         "--tenant-output-len must be at least 1")
    rng = np.random.default_rng([seed, 7])

    def tokens(n: int) -> list[int]:
        return rng.integers(SAFE_TOKEN_ID_MIN, vocab_size - 1, size=n).tolist()

    systems = [tokens(system_len) for _ in range(num_tenants)]
    # Each round in its own order: a fixed order would let round-robin over an even number of
    # replicas send every tenant to the same replica by accident.
    return [BenchRequest(systems[int(t)] + tokens(question_len), output_len)
            for _ in range(users_per_tenant) for t in rng.permutation(num_tenants)]


def _prefix_counters(base_url: str) -> tuple[float, float]:
    """(prompt tokens looked up, tokens hit) over every replica, from the gateway's /metrics."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    values = []
    for name in ("myvllm:prefix_cache_queries_total", "myvllm:prefix_cache_hits_total"):
        match = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
        if match is None:
            raise RuntimeError(f"{name} missing from {base_url}/metrics (no scheduler answered?)")
        values.append(float(match.group(1)))
    return values[0], values[1]


def run(args: argparse.Namespace, vocab_size: int, warmup: BenchRequest) -> int:
    if args.base_url:
        raise ValueError("--workload multi-tenant starts its own deployments (one per policy): drop --base-url")
    policies = [p.strip() for p in args.routing_policies.split(",") if p.strip()]
    concurrency = int(str(args.concurrency).split(",")[0])
    if args.data_parallel_size == 1:
        args.data_parallel_size = DEFAULT_REPLICAS
    dp = args.data_parallel_size
    requests = tenant_requests(args.tenants, args.users_per_tenant, args.system_prompt_len, args.question_len,
                               args.tenant_output_len, vocab_size, args.seed)
    rows, figures = [], {}
    for policy in policies:
        log(f"routing {policy}: starting myvllm serve --data-parallel-size {dp}")
        proc, base_url = start_mesh(args, ["--routing", policy])
        try:
            asyncio.run(run_level(base_url, [warmup], 1))
            queries0, hits0 = _prefix_counters(base_url)
            log(f"routing {policy}: {len(requests)} requests at concurrency {concurrency}")
            result = asyncio.run(run_level(base_url, requests, concurrency, f"routing {policy}"))
            queries1, hits1 = _prefix_counters(base_url)
        finally:
            stop_mesh(proc)
        hit_rate = (hits1 - hits0) / max(queries1 - queries0, 1)
        figures[policy] = {**result.to_dict(), "prefix_cache_hit_rate": hit_rate}
        rows.append([policy, f"{hit_rate:.1%}", f"{result.pct(result.ttft_s, 50):.0f}",
                     f"{result.pct(result.ttft_s, 99):.0f}", f"{result.output_tok_s:.1f}",
                     f"{result.request_s:.2f}"])
    print(f"workload: multi-tenant, {args.tenants} tenants x {args.users_per_tenant} users, system prompts "
          f"{args.system_prompt_len} tokens, questions {args.question_len} tokens, {args.tenant_output_len} output "
          f"tokens, concurrency {concurrency}, {dp} replicas")
    print(format_table(["routing", "prefix hit rate", "TTFT p50 ms", "TTFT p99 ms", "out tok/s", "req/s"], rows))
    if "cache-aware" in figures and "load" in figures:
        ca, lo = figures["cache-aware"], figures["load"]
        hit_ratio = ca["prefix_cache_hit_rate"] / max(lo["prefix_cache_hit_rate"], 1e-9)
        ttft_ratio = ca["ttft_p50_ms"] / lo["ttft_p50_ms"]
        print(f"cache-aware / load: prefix hit rate x{hit_ratio:.2f}, TTFT p50 x{ttft_ratio:.2f}")
    if args.json:
        write_json(args.json, {"multi_tenant": figures})
    return 0
