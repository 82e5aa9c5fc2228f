"""The default deployment (`myvllm serve`, one replica) keeps its streams through its own
faults: kill -9 of the worker, kill -9 of the scheduler, SIGSTOP of the worker for 10 s then
SIGCONT, all with one busy process per core beside it (a loaded machine: restarts, model loads
and migrations take longer, and a race that a quiet machine hides shows). Twelve greedy streams
of 80 tokens are in flight at each fault; every one ends with exactly the text it has without a
fault (the gateway waits for its one replica to be ready again, then resumes each request
token-exact): none ends with an error event or a dropped connection. Afterwards nothing runs
and no KV is held."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
from support.mesh import Mesh
from support.processes import CpuHogs

NUM_STREAMS = 12
MAX_TOKENS = 80
PROMPTS = [f"Write a short story about a {thing}." for thing in (
    "lighthouse", "robot", "dragon", "baker", "river", "violin", "comet", "garden", "train", "owl", "desert", "clock")]


def _pid_of(mesh: Mesh, service: str) -> int:
    """The pid of `service` as serve last started it."""
    return int(re.findall(rf"started {service} \(pid (\d+)\)", "".join(mesh.output))[-1])


def _streams(client: openai.OpenAI, model: str, first_tokens: threading.Barrier | None = None) -> list[str]:
    """The NUM_STREAMS streams' texts; each waits at `first_tokens` once it has its first chunk."""
    def one(prompt: str) -> str:
        text, waited = "", False
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
            if first_tokens is not None and not waited and text:
                waited = True
                first_tokens.wait(timeout=120)
        return text

    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        return list(pool.map(one, PROMPTS))


def test_one_replica_streams_survive_worker_and_scheduler_faults(smollm2_dir: str, cpu_hogs: CpuHogs) -> None:
    mesh = Mesh(["--model", smollm2_dir, "--max-model-len", "1024", "--kv-cache-memory", str(128 << 20)])
    try:
        client = openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="none", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        want = _streams(client, model)
        assert all(len(text) > 0 for text in want)
        cpu_hogs.start()

        def worker_kill() -> None:
            os.kill(_pid_of(mesh, "worker"), signal.SIGKILL)

        def scheduler_kill() -> None:
            os.kill(_pid_of(mesh, "scheduler"), signal.SIGKILL)

        def worker_stop() -> None:
            pid = _pid_of(mesh, "worker")
            os.kill(pid, signal.SIGSTOP)
            time.sleep(10)
            os.kill(pid, signal.SIGCONT)

        report = []
        for name, fault in (("worker kill -9", worker_kill), ("scheduler kill -9", scheduler_kill),
                            ("worker SIGSTOP 10 s", worker_stop)):
            migrations_before = mesh.metrics()["myvllm:request_migrations_total"]
            # The action runs when every stream has its first chunk: all twelve are mid-stream.
            first_tokens = threading.Barrier(NUM_STREAMS + 1)
            with ThreadPoolExecutor(1) as pool:
                got = pool.submit(_streams, client, model, first_tokens)
                first_tokens.wait(timeout=120)
                started = time.monotonic()
                fault()
                texts = got.result(timeout=600)
            took = time.monotonic() - started
            migrated = mesh.metrics()["myvllm:request_migrations_total"] - migrations_before
            exact = sum(t == w for t, w in zip(texts, want, strict=True))
            report.append(f"{name}: {exact}/{NUM_STREAMS} exact, {migrated:g} migrations, {took:.1f} s")
            assert texts == want, report
        print("; ".join(report))
        cpu_hogs.stop()
        deadline = time.monotonic() + 30
        while True:  # at rest: nothing running, no KV in use
            metrics = mesh.metrics()
            if metrics["myvllm:num_requests_running"] == 0 and metrics["myvllm:kv_cache_usage_perc"] == 0:
                break
            assert time.monotonic() < deadline, metrics
            time.sleep(0.25)
        assert mesh.proc.poll() is None  # serve itself never went down
    finally:
        assert mesh.stop() == 0
        assert mesh.leftovers == []
