"""A data-parallel expert-parallel group served by `myvllm serve --data-parallel-size 2
--enable-expert-parallel` (tiny random Qwen3-MoE, real redis-server, real processes), and the DP
wave protocol it runs (services/common/dp_wave.py):

- the official `openai` client gets the offline single-rank engine's greedy text, and the
  gateway's first request to the paused group is announced with FIRST_REQ; that FIRST_REQ
  sent again is dropped and counted, and the paused group stays paused;
- requests to one engine only (straight to its scheduler): the other runs dummy steps, both
  pause when done, and the wave number in Redis advances by exactly one;
- a request carrying an old wave, sent to the other (paused) engine, starts both again;
- Redis restarts empty: the group goes on serving, and the coordinator writes its wave back;
- kill -9 of one engine's worker while streams are in flight on both engines stops the whole
  group with a clear error, `serve` restarts it as a group, and every stream ends with exactly
  its text without the fault (the gateway migrates them as for dense replicas).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import redis
from support.mesh import Mesh
from support.processes import free_port, start_redis, stop_process

from services.client.grpc_client import AsyncClient
from services.common.dp_wave import coordinator_channel, parse_wave_entry, wave_key
from services.common.proto import myvllm_pb2 as pb
from services.offline.llm import LLM

TOKEN = "dp-wave-test-token"
GROUP = "default"
PROMPTS = ["The quick brown fox", "Mixture of experts", "A wave of requests"]
MAX_TOKENS = 12


def _offline_texts(model_dir: str) -> list[str]:
    llm = LLM(model_dir, dtype="float32", seed=0)
    try:
        from services.common.sampling_params import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.close()


def _wave(client: redis.Redis) -> tuple[int, bool]:
    found = parse_wave_entry(client.hgetall(wave_key(GROUP)), TOKEN, GROUP)
    assert found is not None, client.hgetall(wave_key(GROUP))
    return found


def _engines(client: redis.Redis) -> dict[int, str]:
    """dp rank -> scheduler address, from the engines' Redis entries."""
    entries = [json.loads(v) for v in client.hgetall("myvllm:engines").values()]
    return {e["dp_rank"]: e["address"] for e in entries if e.get("dp_group") == GROUP and time.time() - e["ts"] < 5}


async def _generate(address: str, prompt: list[int], dp_wave: int) -> list[int]:
    client = AsyncClient(address, token=TOKEN)
    try:
        params = pb.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        tokens: list[int] = []
        async for out in client.generate(prompt, params, dp_wave=dp_wave):
            tokens.extend(out.new_token_ids)
        return tokens
    finally:
        await client.close()


async def _stats(address: str) -> pb.Stats:
    client = AsyncClient(address, token=TOKEN)
    try:
        return await client.get_stats()
    finally:
        await client.close()


def _wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _completions(client: openai.OpenAI, model: str) -> list[str]:
    return [client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]


STREAM_TOKENS = 48


def _streams(client: openai.OpenAI, model: str, first_chunks: threading.Barrier | None = None) -> list[str]:
    """Every prompt streamed at once; each waits at `first_chunks` once it has its first text."""
    def one(prompt: str) -> str:
        text, waited = "", False
        for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=STREAM_TOKENS, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
            text += chunk.choices[0].text if chunk.choices else ""
            if first_chunks is not None and not waited and text:
                waited = True
                first_chunks.wait(timeout=120)
        return text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def test_served_expert_parallel_group_runs_waves_and_restarts_as_a_group(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("qwen3_moe")
    want = _offline_texts(model_dir)
    redis_port = free_port()
    redis_proc = start_redis(redis_port)
    redis_server = f"redis://127.0.0.1:{redis_port}"
    db = redis.Redis.from_url(redis_server)
    coordinator = db.pubsub()
    coordinator.subscribe(coordinator_channel(GROUP))
    mesh = Mesh(["--model", model_dir, "--data-parallel-size", "2", "--enable-expert-parallel", "--redis", redis_server,
                 "--kv-cache-memory", str(16 << 20)], env={"MYVLLM_INTERNAL_TOKEN": TOKEN}, one_replica=False)
    try:
        client = openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        wave0, running = _wave(db)
        assert not running
        assert _completions(client, model) == want
        firsts = []
        while (message := coordinator.get_message(timeout=0.5)) is not None:
            if message["type"] == "message":
                firsts.append(message["data"])
        assert any(json.loads(m)["type"] == "FIRST_REQ" for m in firsts), firsts

        # Requests to engine 0 only: engine 1 runs dummy steps; one wave, and both pause.
        engines = _engines(db)
        assert sorted(engines) == [0, 1], engines
        _wait_until(lambda: not _wave(db)[1], 30, "the group to pause")
        wave1 = _wave(db)[0]

        # A captured FIRST_REQ sent again is dropped (replayed, or stale by now) and counted; the
        # paused group stays paused at its wave.
        first_req = next(m for m in firsts if json.loads(m)["type"] == "FIRST_REQ")
        db.publish(coordinator_channel(GROUP), first_req)
        _wait_until(lambda: (lambda s: s.dp_wave_messages_replayed + s.dp_wave_messages_stale)(
            asyncio.run(_stats(engines[0]))) >= 1, 10, "the coordinator to drop the replayed FIRST_REQ")
        time.sleep(0.5)
        assert _wave(db) == (wave1, False)
        assert "myvllm:dp_wave_messages_dropped_total" in mesh.metrics()
        before = asyncio.run(_stats(engines[1]))
        prompt = [int(t) for t in range(100, 120)]
        tokens = asyncio.run(_generate(engines[0], prompt, wave1))
        assert len(tokens) == MAX_TOKENS
        _wait_until(lambda: _wave(db) == (wave1 + 1, False), 30, "the wave to end")
        after = asyncio.run(_stats(engines[1]))
        assert after.num_dummy_steps - before.num_dummy_steps >= MAX_TOKENS
        assert after.num_steps == before.num_steps  # none of them a real step
        assert (after.dp_wave, after.dp_engines_running) == (wave1 + 1, False)

        # A request with an old wave at the paused engine 1 starts both again.
        before0 = asyncio.run(_stats(engines[0]))
        assert asyncio.run(_generate(engines[1], prompt, wave1)) == tokens  # same greedy tokens either engine
        _wait_until(lambda: _wave(db) == (wave1 + 2, False), 30, "the restarted wave to end")
        after0 = asyncio.run(_stats(engines[0]))
        assert after0.num_dummy_steps - before0.num_dummy_steps >= MAX_TOKENS

        # Redis restarts empty: requests still run (the engines ask until the coordinator hears),
        # and the coordinator writes the wave state back.
        stop_process(redis_proc)
        redis_proc = start_redis(redis_port)
        assert _completions(client, model) == want
        _wait_until(lambda: db.hgetall(wave_key(GROUP)) != {} and _wave(db)[0] > wave1 + 2, 30,
                    "the wave state back in redis")

        # A dead rank stops the group, streams in flight; serve restarts it as a group and the
        # gateway migrates the streams.
        want_streams = _streams(client, model)
        output = "".join(mesh.output)
        worker_pid = int(re.findall(r"started worker-1 \(pid (\d+)\)", output)[-1])
        restarts = output.count("stopping the expert-parallel group")
        first_chunks = threading.Barrier(len(PROMPTS) + 1)
        with ThreadPoolExecutor(1) as pool:
            streams = pool.submit(_streams, client, model, first_chunks)
            first_chunks.wait(timeout=120)
            os.kill(worker_pid, signal.SIGKILL)
            assert streams.result(timeout=300) == want_streams
        assert mesh.metrics()["myvllm:request_migrations_total"] >= 1
        _wait_until(lambda: "".join(mesh.output).count("stopping the expert-parallel group") > restarts, 60,
                    "serve to stop the group")
        assert re.search(rf"worker-1 \(pid {worker_pid}\) exited with code -9; stopping the expert-parallel group",
                         "".join(mesh.output))
        _wait_until(lambda: len(_engines(db)) == 2 and _healthy(client), 180, "the group to come back")
        assert _completions(client, model) == want
        assert _wave(db)[0] >= wave1 + 2  # wave numbers never go back
    finally:
        coordinator.close()
        mesh.stop()
        stop_process(redis_proc)
    assert mesh.leftovers == []


def _healthy(client: openai.OpenAI) -> bool:
    try:
        client.completions.create(model=client.models.list().data[0].id, prompt="hi", max_tokens=1)
        return True
    except openai.APIError:
        return False


@pytest.mark.parametrize("raw, why", [
    ("nope", "not JSON"),
    (json.dumps({"type": "START_DP_WAVE", "wave": 1, "exclude": 0}), "unexpected message type"),
    (json.dumps({"type": "FIRST_REQ", "wave": -1, "engine": 0}), "wave is not a count"),
    (json.dumps({"type": "FIRST_REQ", "wave": 3, "engine": 2}), "not one of the group's 2"),
])
def test_coordinator_messages_are_checked(raw: str, why: str) -> None:
    from services.common.dp_wave import decode_message
    from services.common.redis_registry import BadEntry

    with pytest.raises(BadEntry, match=why):
        decode_message(coordinator_channel(GROUP), raw, None, 2)


def test_signed_wave_messages_and_entries_need_the_token() -> None:
    from services.common.dp_wave import FIRST_REQ, decode_message, encode_message, wave_entry
    from services.common.redis_registry import BadEntry

    channel = coordinator_channel(GROUP)
    text = encode_message(channel, {"type": FIRST_REQ, "engine": 1, "wave": 7}, TOKEN)
    assert decode_message(channel, text, TOKEN, 2)["wave"] == 7
    with pytest.raises(BadEntry, match="MAC"):
        decode_message(channel, text, "another token", 2)
    forged = json.loads(text)
    forged["wave"] = 8
    with pytest.raises(BadEntry, match="MAC"):
        decode_message(channel, json.dumps(forged), TOKEN, 2)
    fields = wave_entry(5, True, TOKEN, GROUP)
    assert parse_wave_entry(fields, TOKEN, GROUP) == (5, True)
    assert parse_wave_entry(fields, "another token", GROUP) is None
    assert parse_wave_entry({**fields, "current_wave": "6"}, TOKEN, GROUP) is None


@pytest.mark.parametrize("redis_url, rank, address, group, why", [
    (None, 0, "127.0.0.1:5", "g", "needs --redis"),
    ("redis://h:1", 2, "127.0.0.1:5", "g", "--data-parallel-rank 2 is outside"),
    ("redis://h:1", 0, "127.0.0.1", "g", "needs --data-parallel-address HOST:PORT"),
    ("redis://h:1", 0, "127.0.0.1:5", "a b", "--dp-group must be a name"),
])
def test_a_group_scheduler_refuses_missing_or_bad_group_flags(redis_url, rank, address, group, why) -> None:
    from services.common.config import VllmConfig
    from services.common.grpc_utils import StartupError
    from services.scheduler.server import _check_group

    config = VllmConfig.from_engine_args(model="", data_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(StartupError, match=why):
        _check_group(config, redis_url, rank, address, group)
    assert _check_group(config, "redis://h:1", 1, "127.0.0.1:5", "g") == "tcp://127.0.0.1:5/0"
    dense = VllmConfig.from_engine_args(model="", data_parallel_size=2)  # independent replicas
    assert _check_group(dense, None, 0, None, "g") is None
