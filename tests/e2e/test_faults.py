"""Faults with real processes (docs/design.md, "Faults"): two engine replicas (worker + scheduler
processes) publishing to their own redis-server, one gateway process that finds them there,
the official `openai` client. A scheduler or a worker is killed with SIGKILL mid-generation
and every stream must end with exactly the text it has without the fault; Redis dies and
routing goes on; a soak with random client disconnects leaks no KV block and little memory;
SIGTERM drains the gateway. Figures (migrations, recovery time, soak numbers) are printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from support.processes import free_port, start_redis, stop_process
from support.replica import Replica

from services.common.redis_registry import read_engine_loads
from services.common.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
MAX_NUM_SEQS = 16
STREAM_PROMPTS = [f"List the numbers from {i} to {i + 30}, one per line:" for i in range(12)]
STREAM_TOKENS = 64  # long enough that every stream is still running when the fault comes


class Deployment:
    """Redis, two replicas and a gateway process; replicas and Redis can be killed and restarted."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.redis_port = free_port()
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}"
        self.redis = start_redis(self.redis_port)
        self.replicas: list[Replica] = []
        self.gateway: subprocess.Popen | None = None
        try:  # a set-up that fails half-way stops what it had started
            for _ in range(2):
                self.replicas.append(Replica(model_dir, self.redis_url, MAX_NUM_SEQS))
            for replica in self.replicas:
                replica.wait_ready()
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.gateway_log = tempfile.TemporaryFile()
            self.gateway = subprocess.Popen(
                [sys.executable, "-m", "services.entrypoints.cli", "gateway", "--host", "127.0.0.1", "--port",
                 str(self.port), "--redis", self.redis_url, "--model", model_dir, "--migration-wait", "60",
                 "--shutdown-timeout", "20"], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                stdout=self.gateway_log, stderr=self.gateway_log)
            self.wait_routed()
        except BaseException:
            self.stop()
            raise

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)

    def wait_routed(self, timeout_s: float = 60) -> None:
        """Until both replicas publish to Redis and the gateway answers /health."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.gateway.poll() is None, f"gateway exited: {self.gateway_tail()}"
            published = asyncio.run(_published_addresses(self.redis_url))
            if published >= {r.address for r in self.replicas} and _http_ok(f"{self.url}/health"):
                break
            assert time.monotonic() < deadline, f"not routed: published {published}"
            time.sleep(0.25)
        time.sleep(1.0)  # the router reads Redis every 0.25 s

    def restart_replica(self, index: int) -> None:
        self.replicas[index].stop()
        self.replicas[index] = Replica(self.model_dir, self.redis_url, MAX_NUM_SEQS)
        self.replicas[index].wait_ready()
        self.wait_routed()

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rpartition(" ")[2])
        raise AssertionError(f"no metric {name}")

    def assert_idle(self, timeout_s: float = 30) -> None:
        """/metrics (summed over the replicas) settles at nothing running and no KV in use."""
        deadline = time.monotonic() + timeout_s
        while True:
            running, usage = self.metric("myvllm:num_requests_running"), self.metric("myvllm:kv_cache_usage_perc")
            if running == 0 and usage == 0:
                return
            assert time.monotonic() < deadline, f"after the fault: {running} running, KV usage {usage}"
            time.sleep(0.25)

    def gateway_rss_mb(self) -> float:
        with open(f"/proc/{self.gateway.pid}/status") as status:
            line = next(line for line in status if line.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024

    def gateway_tail(self) -> str:
        self.gateway_log.seek(0)
        return self.gateway_log.read().decode(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.gateway is not None and self.gateway.poll() is None:
            stop_process(self.gateway)
        for replica in self.replicas:
            replica.stop()
        stop_process(self.redis)


async def _published_addresses(redis_url: str) -> set[str]:
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_url)
    try:
        return {entry["address"] for entry in (await read_engine_loads(client, max_age_s=5.0)).values()}
    except Exception:
        return set()
    finally:
        await client.aclose()


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def deployment(smollm2_dir: str) -> Iterator[Deployment]:
    deployment = Deployment(smollm2_dir)
    try:
        yield deployment
    finally:
        deployment.stop()


def _complete(client: openai.OpenAI, prompt: str) -> str:
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=STREAM_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


@pytest.fixture(scope="module")
def no_fault_texts(deployment: Deployment) -> list[str]:
    """Every stream prompt's greedy completion, with nothing failing."""
    client = deployment.client()
    with ThreadPoolExecutor(len(STREAM_PROMPTS)) as pool:
        texts = list(pool.map(lambda p: _complete(client, p), STREAM_PROMPTS))
    assert all(texts)
    return texts


def _busiest_replica(deployment: Deployment) -> int:
    """The replica with the most requests running now: the one whose fault has streams to migrate
    (chosen by state, not by timing: under load the router may have sent most streams to either)."""
    running = [replica.stats().num_running for replica in deployment.replicas]
    return max(range(len(running)), key=running.__getitem__)


def _streams_through_a_fault(deployment: Deployment, expected: list[str], kill: Callable[[int], None]) -> dict:
    """12 greedy streams; once every one has its first token, `kill(index)` of the replica with the
    most of them running; every stream must end with exactly its no-fault text. Returns the
    figures and the index of the replica killed."""
    client = deployment.client()
    num_chunks = [0] * len(STREAM_PROMPTS)
    first_chunk_after_kill: list[float | None] = [None] * len(STREAM_PROMPTS)
    killed_at: list[float] = []

    def stream(i: int) -> str:
        text = []
        for chunk in client.completions.create(model=MODEL, prompt=STREAM_PROMPTS[i], max_tokens=STREAM_TOKENS,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True}):
            text.append(chunk.choices[0].text)
            num_chunks[i] += 1
            if killed_at and first_chunk_after_kill[i] is None:
                first_chunk_after_kill[i] = time.monotonic() - killed_at[0]
        return "".join(text)

    migrations_before = deployment.metric("myvllm:request_migrations_total")
    with ThreadPoolExecutor(len(STREAM_PROMPTS)) as pool:
        futures = [pool.submit(stream, i) for i in range(len(STREAM_PROMPTS))]
        deadline = time.monotonic() + 120
        while min(num_chunks) < 1:  # a stream that finishes early is fine: others are still running
            assert time.monotonic() < deadline, f"streams did not start: {num_chunks}"
            time.sleep(0.01)
        victim = _busiest_replica(deployment)
        in_flight_at_kill = sum(not f.done() for f in futures)
        killed_at.append(time.monotonic())
        kill(victim)
        results, errors = [], []
        for future in futures:
            try:
                results.append(future.result(timeout=180))
            except Exception as e:  # counted, then asserted on: the figures show what failed
                results.append(None)
                errors.append(repr(e))
    exact = sum(result == want for result, want in zip(results, expected, strict=True))
    figures = {
        "streams": len(STREAM_PROMPTS), "in_flight_at_kill": in_flight_at_kill, "exact": exact, "errored": len(errors),
        "migrated": int(deployment.metric("myvllm:request_migrations_total") - migrations_before),
        "recovery_s": round(max(t for t in first_chunk_after_kill if t is not None), 2),
    }
    print(f"\n{kill.__name__}: {json.dumps(figures)}")
    assert not errors, errors
    assert exact == len(STREAM_PROMPTS), [(r, w) for r, w in zip(results, expected, strict=True) if r != w]
    assert figures["migrated"] >= 1, "the killed replica was serving none of the streams"
    return {**figures, "victim": victim}


def test_scheduler_killed_mid_stream(deployment: Deployment, no_fault_texts: list[str]) -> None:
    def kill_scheduler(index: int) -> None:
        deployment.replicas[index].scheduler.send_signal(signal.SIGKILL)

    victim = _streams_through_a_fault(deployment, no_fault_texts, kill_scheduler)["victim"]
    deployment.assert_idle()  # the surviving replica finished and freed everything
    deployment.restart_replica(victim)
    deployment.assert_idle()


def test_worker_killed_mid_stream(deployment: Deployment, no_fault_texts: list[str]) -> None:
    """The scheduler survives and fails its requests (an error without a kind on this side of
    the engine work: treated as ENGINE_FAULT); the gateway migrates them."""
    def kill_worker(index: int) -> None:
        deployment.replicas[index].worker.send_signal(signal.SIGKILL)

    victim = _streams_through_a_fault(deployment, no_fault_texts, kill_worker)["victim"]
    deployment.assert_idle()
    deployment.restart_replica(victim)
    deployment.assert_idle()


def test_redis_killed_routing_goes_on_and_recovers(deployment: Deployment, no_fault_texts: list[str]) -> None:
    client = deployment.client()
    deployment.redis.send_signal(signal.SIGKILL)
    deployment.redis.wait(timeout=5)
    time.sleep(1.0)  # several router refreshes fail meanwhile
    steps_before = [r.num_steps() for r in deployment.replicas]
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda i: _complete(client, STREAM_PROMPTS[i]), range(8)))
    assert texts == no_fault_texts[:8]
    served = [r.num_steps() - before for r, before in zip(deployment.replicas, steps_before, strict=True)]
    assert all(s > 0 for s in served), f"routing lost a replica without Redis: steps per replica {served}"

    deployment.redis = start_redis(deployment.redis_port)  # Redis returns, empty

    def complete(i: int) -> str:
        try:
            return _complete(client, STREAM_PROMPTS[i])
        except openai.APIError as e:  # what the gateway saw, for a failure under load
            raise AssertionError(f"{e!r}\ngateway log:\n{deployment.gateway_tail()}") from e

    with ThreadPoolExecutor(4) as pool:  # at once: before the schedulers have published again
        texts = list(pool.map(complete, range(4)))
    assert texts == no_fault_texts[:4]
    deployment.wait_routed()  # the schedulers publish again and the gateway routes by it
    assert _complete(client, STREAM_PROMPTS[0]) == no_fault_texts[0]
    deployment.assert_idle()


def test_n_seeded_choices_distinct_reproducible_and_as_offline(deployment: Deployment, smollm2_dir: str) -> None:
    from services.offline.llm import LLM

    prompt = "Once upon a time"
    client = deployment.client()

    def ask() -> list[str]:
        reply = client.completions.create(model=MODEL, prompt=prompt, n=3, seed=42, temperature=1.0, max_tokens=8,
                                          extra_body={"ignore_eos": True})
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    served = ask()
    assert len(set(served)) == 3, served
    assert ask() == served
    llm = LLM(smollm2_dir, dtype="float32", seed=0, max_num_seqs=4, max_model_len=256)
    (offline,) = llm.generate(prompt, SamplingParams(n=3, seed=42, temperature=1.0, max_tokens=8, ignore_eos=True),
                              use_tqdm=False)
    llm.close()
    assert [c.text for c in offline.outputs] == served


# Enough for a leak of a few KB per request to show in the gateway's RSS; bounded in time (~35 s).
SOAK_REQUESTS = 1000


def test_soak_with_random_disconnects_leaks_nothing(deployment: Deployment) -> None:
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(16)]
    outcomes: Counter[str] = Counter()

    async def one(i: int, http: httpx.AsyncClient, rng: random.Random) -> None:
        body = {"model": MODEL, "prompt": prompts[i % len(prompts)], "max_tokens": rng.randint(1, 2),
                "temperature": rng.choice([0.0, 1.0])}
        roll = rng.random()
        try:
            if roll < 0.4:
                response = await http.post("/v1/completions", json=body)
                outcomes[f"json {response.status_code}"] += 1
            elif roll < 0.85:
                async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                    async for line in response.aiter_lines():
                        if roll < 0.7 and line.startswith("data: {"):
                            outcomes[f"stream dropped {response.status_code}"] += 1
                            return  # the client goes away mid-stream
                        assert '"error"' not in line, line
                    outcomes[f"stream {response.status_code}"] += 1
            else:  # the client gives up before the answer
                response = await http.post("/v1/completions", json={**body, "max_tokens": 3},
                                           timeout=rng.uniform(0.005, 0.1))
                outcomes[f"json {response.status_code}"] += 1
        except httpx.TimeoutException:
            outcomes["client timed out"] += 1

    async def soak(num_requests: int, seed: int) -> None:
        rng = random.Random(seed)
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
        async with httpx.AsyncClient(base_url=deployment.url, timeout=60, limits=limits) as http:
            gate = asyncio.Semaphore(32)

            async def bounded(i: int) -> None:
                async with gate:
                    await one(i, http, rng)

            await asyncio.gather(*(bounded(i) for i in range(num_requests)))

    asyncio.run(asyncio.wait_for(soak(100, seed=1), 120))  # warm-up: caches, pools, lazy imports
    rss_before = deployment.gateway_rss_mb()
    outcomes.clear()
    started = time.monotonic()
    asyncio.run(asyncio.wait_for(soak(SOAK_REQUESTS, seed=2), 300))
    elapsed = time.monotonic() - started
    deadline = time.monotonic() + 30
    while True:  # aborts travel asynchronously: give the engines a moment to settle
        stats = [r.stats() for r in deployment.replicas]
        if all(s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks for s in stats):
            break
        leaked = [(s.num_running, s.num_waiting, s.num_free_blocks, s.num_total_blocks) for s in stats]
        assert time.monotonic() < deadline, f"leaked (running, waiting, free, total blocks): {leaked}"
        time.sleep(0.2)
    rss_growth = deployment.gateway_rss_mb() - rss_before
    print(f"\nsoak: {sum(outcomes.values())} requests in {elapsed:.1f}s, {dict(outcomes)}, "
          f"gateway RSS growth {rss_growth:.1f} MB")
    assert sum(outcomes.values()) == SOAK_REQUESTS
    assert all(not key.endswith(("500", "503", "400")) for key in outcomes), outcomes
    assert rss_growth < 50, f"gateway RSS grew by {rss_growth:.1f} MB"


def test_sigterm_drains_the_gateway(deployment: Deployment, no_fault_texts: list[str]) -> None:
    """Last in this module: it stops the gateway. In-flight streams finish, new requests get 503."""
    client = deployment.client()
    chunks: list[str] = []
    with ThreadPoolExecutor(1) as pool:
        def stream() -> str:
            for chunk in client.completions.create(model=MODEL, prompt=STREAM_PROMPTS[0], max_tokens=STREAM_TOKENS,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True}):
                chunks.append(chunk.choices[0].text)
            return "".join(chunks)

        in_flight = pool.submit(stream)
        deadline = time.monotonic() + 60
        while len(chunks) < 2:
            assert time.monotonic() < deadline and not in_flight.done()
            time.sleep(0.01)
        deployment.gateway.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while True:  # until the gateway has handled the signal (not a fixed sleep: a loaded machine is slow)
            refused = httpx.post(f"{deployment.url}/v1/completions",
                                 json={"model": MODEL, "prompt": "hi", "max_tokens": 1}, timeout=10)
            if refused.status_code != 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down", refused.text
        assert in_flight.result(timeout=60) == no_fault_texts[0]
    deployment.gateway.wait(timeout=30)  # it exits once nothing is in flight
