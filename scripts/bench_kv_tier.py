"""The KV tier's two measurements, each against the same server without a tier, same run:

  replay   48 two-turn conversations (each with its own 448-token context) whose prefixes total
           about 3x the KV pool, turns interleaved across conversations, replayed twice at
           concurrency 1: the second pass's TTFT p50 with the tier against without it, and
           whether every greedy text is the same.
  restart  12 streams with 512-token prompts in flight when the worker is killed (-9): the prompt
           tokens the restarted worker computes for the migrated requests (the gateway resumes
           each with its prompt and the tokens it had), from /metrics, with the tier against
           without it.

    .venv/bin/python scripts/bench_kv_tier.py [replay|restart|both] [--model DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_TOKENS = 160  # (restart: the streams are still going when the worker dies)
DISK_CACHED = 'vllm:prompt_tokens_cached_by_source_total{source="disk"}'
DEVICE_CACHED = 'vllm:prompt_tokens_cached_by_source_total{source="device"}'


class Serve:
    """`myvllm serve` on a free port, until stop()."""

    def __init__(self, model: str, args: list[str]) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "services.entrypoints.cli", "serve", "--model", model, "--port", str(self.port),
               "--dtype", "float32", *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.output: list[str] = []
        for line in self.proc.stdout:
            self.output.append(line)
            if line.startswith("Press Ctrl-C"):
                break
        else:
            raise RuntimeError("serve exited: " + "".join(self.output)[-2000:])
        threading.Thread(target=lambda: [self.output.append(x) for x in self.proc.stdout], daemon=True).start()
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                                    timeout=600)
        self.model = self.client.models.list().data[0].id

    def pid_of(self, service: str) -> int:
        return int(re.findall(rf"started {service} \(pid (\d+)\)", "".join(self.output))[-1])

    def metrics(self) -> dict[str, float]:
        values: dict[str, float] = {}
        for line in httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                labels = ",".join(x for x in re.findall(r'(\w+="[^"]*")', name)
                                  if not x.startswith(("model_name=", "engine=")))
                values[name.split("{")[0] + (f"{{{labels}}}" if labels else "")] = float(value)
        return values

    def stream(self, prompt: list[int], max_tokens: int, first: threading.Barrier | None = None) -> tuple[float, list]:
        """(TTFT seconds, the text's chunks)."""
        start, ttft, chunks = time.perf_counter(), None, []
        for chunk in self.client.completions.create(model=self.model, prompt=prompt, max_tokens=max_tokens,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True}):
            text = chunk.choices[0].text if chunk.choices else ""
            if text and ttft is None:
                ttft = time.perf_counter() - start
                if first is not None:
                    first.wait(timeout=300)
            chunks.append(text)
        return ttft or 0.0, chunks

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


def replay(model: str) -> None:
    rng = random.Random(1)
    contexts = [[rng.randrange(100, 40000) for _ in range(448)] for _ in range(48)]
    questions = [([rng.randrange(100, 40000) for _ in range(16)], [rng.randrange(100, 40000) for _ in range(16)])
                 for _ in contexts]
    total_tokens = sum(len(c) + 32 + 16 for c in contexts)
    pool_blocks = total_tokens // 16 // 3
    print(f"replay: 48 conversations, {total_tokens} prefix tokens, KV pool {pool_blocks} blocks (1/3 of them)")
    results = {}
    for label, extra in (("no tier", []), ("tier", ["--kv-offloading-size", "2",
                                                    "--kv-offloading-dir", tempfile.mkdtemp(prefix="kvtier-")])):
        serve = Serve(model, ["--num-gpu-blocks-override", str(pool_blocks + 1), "--max-model-len", "1024", *extra])
        try:
            passes = []
            for _ in range(2):
                ttfts, texts = [], []
                # Every conversation's first turn, then every second turn (which carries the first:
                # the second question follows it), as many tenants' conversations interleave: a
                # conversation's prefix has been evicted from the pool by the others' when it goes on.
                for turn in range(2):
                    for context, (q1, q2) in zip(contexts, questions, strict=True):
                        ttft, chunks = serve.stream(context + q1 + (q2 if turn else []), 16)
                        ttfts.append(ttft)
                        texts.append("".join(chunks))
                passes.append((ttfts, texts))
            metrics = serve.metrics()
        finally:
            serve.stop()
        results[label] = passes
        p50 = [statistics.median(t) * 1000 for t, _ in passes]
        loads = metrics.get('myvllm:kv_tier_loads_total{outcome="ok"}', 0)
        disk = metrics.get(DISK_CACHED, 0)
        device = metrics.get(DEVICE_CACHED, 0)
        print(f"  {label}: TTFT p50 pass 1 {p50[0]:.1f} ms, pass 2 {p50[1]:.1f} ms; tier loads {loads:g}, "
              f"prompt tokens cached from the tier {disk:g}, from the pool {device:g}")
    same = results["tier"][1][1] == results["no tier"][1][1] and results["tier"][0][1] == results["no tier"][0][1]
    ratio = statistics.median(results["no tier"][1][0]) / statistics.median(results["tier"][1][0])
    print(f"replay: second-pass TTFT p50 without / with the tier: {ratio:.2f}x; greedy texts identical: {same}")


def restart(model: str) -> None:
    rng = random.Random(2)
    prompts = [[rng.randrange(100, 40000) for _ in range(512)] for _ in range(12)]
    texts = {}
    for label, extra in (("no tier", []), ("tier", ["--kv-offloading-size", "2",
                                                    "--kv-offloading-dir", tempfile.mkdtemp(prefix="kvtier-")])):
        serve = Serve(model, ["--max-model-len", "1024", "--kv-cache-memory", str(640 << 20), *extra])
        try:
            want = [serve.stream(p, MAX_TOKENS)[1] for p in prompts[:1]]  # (warm-up, and one reference)
            first = threading.Barrier(len(prompts) + 1)
            with ThreadPoolExecutor(len(prompts)) as pool:
                futures = [pool.submit(serve.stream, p, MAX_TOKENS, first) for p in prompts]
                first.wait(timeout=300)
                time.sleep(1.0)  # a few tokens each, and the writer's copies on disk
                before = serve.metrics()  # (every first attempt's prompt counted: its first token is out)
                os.kill(serve.pid_of("worker"), signal.SIGKILL)
                got = [f.result(timeout=600)[1] for f in futures]
            after = serve.metrics()
        finally:
            serve.stop()

        def delta(name: str, after: dict = after, before: dict = before) -> float:
            """What `name` counted since `before` (a replica whose engine core was rebuilt for the
            restarted worker counts from zero again: then all of it)."""
            a, b = after.get(name, 0.0), before.get(name, 0.0)
            return a - b if a >= b else a

        # The resumed attempts' prompts (each the prompt and the tokens it had) as the engine saw them:
        # looked up in the pool, found there, loaded from the tier; the rest computed.
        queried = delta("vllm:prefix_cache_queries_total")
        pool_hits = delta("vllm:prefix_cache_hits_total")
        tier_hits = delta("vllm:external_prefix_cache_hits_total")
        exact = "".join(got[0]) == "".join(want[0])
        texts[label] = ["".join(g) for g in got]
        print(f"restart, {label}: migrations {delta('myvllm:request_migrations_total'):g}; the resumed attempts' "
              f"prompt tokens {queried:g}: from the pool {pool_hits:g}, loaded from the tier {tier_hits:g}, "
              f"computed {queried - pool_hits - tier_hits:g}; first stream exact: {exact}")
    print(f"restart: the 12 streams' texts with the tier equal those without: {texts['tier'] == texts['no tier']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", default="both", choices=("replay", "restart", "both"))
    parser.add_argument("--model", default=os.path.join(REPO, "models", "SmolLM2-135M-Instruct"))
    args = parser.parse_args()
    if args.what in ("replay", "both"):
        replay(args.model)
    if args.what in ("restart", "both"):
        restart(args.model)


if __name__ == "__main__":
    main()
