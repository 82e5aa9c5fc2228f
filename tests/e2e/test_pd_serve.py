"""Prefill/decode disaggregation as users run it: `myvllm serve --prefill-replicas 1
--decode-replicas 1`, the official `openai` client, the real model. Greedy text equals the
colocated mesh's (the one-replica `serve` of the same flags), for completions and chat, streamed
and not; each new prompt's KV goes through shared memory once (the decode replica loads it) and a
repeated prompt is served from the decode replica's prefix cache without a second transfer;
every block is free on both replicas afterwards. Then kill -9 of the prefill replica's worker
while streams are being prefilled: every stream still ends with the no-fault text (the decode
replica prefills what it cannot load), and the time it took is printed; and kill -9 of the decode
replica's worker mid-stream: the streams migrate and end with the same text. Both faults happen
with one busy process per core beside the mesh (restarts and migrations as slow as on a loaded
machine): no stream ends with an error or a dropped connection."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from support.mesh import Mesh
from support.processes import CpuHogs

FLAGS = ["--max-model-len", "1024", "--kv-cache-memory", str(96 << 20)]
MAX_TOKENS = 24
# Long enough for several blocks of 16 tokens each.
PROMPTS = [f"Write a detailed story, with a beginning, a middle and an end, about a {thing} that learns to "
           f"sing. Describe the weather, the town and the people who live there, and end with a lesson."
           for thing in ("lighthouse", "robot", "dragon", "baker", "river", "violin", "comet", "garden")]
FRESH = [p.replace("sing", "dance") for p in PROMPTS]
CHAT = [{"role": "user", "content": "Explain in three sentences why the sky is blue, for a ten-year-old reader."}]


def _texts(client: openai.OpenAI, model: str, prompts: list[str], stream: bool,
           first_tokens: threading.Barrier | None = None) -> list[str]:
    """Each prompt's text (streams wait at `first_tokens` once they have their first chunk)."""
    def one(prompt: str) -> str:
        if not stream:
            return client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
        chunks = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        text, waited = "", first_tokens is None
        for c in chunks:
            text += c.choices[0].text if c.choices else ""
            if not waited and text:
                waited = True
                first_tokens.wait(timeout=120)
        return text

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _chat(client: openai.OpenAI, model: str) -> str:
    return client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS,
                                          temperature=0).choices[0].message.content


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def _features(client: openai.OpenAI, model: str) -> list:
    """What else must behave as in the colocated mesh: a stop string with logprobs, a structured
    output, n=2 seeded samples (three new prompts: three transfers)."""
    stopped = client.completions.create(model=model, prompt=PROMPTS[0].replace("sing", "paint"), max_tokens=40,
                                        temperature=0, stop=["."], logprobs=2)
    structured = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Invent a person who lives in a lighthouse and describe "
                                "them as JSON with their name and age."}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    sampled = client.completions.create(model=model, prompt=PROMPTS[1].replace("sing", "swim"), max_tokens=12,
                                        temperature=0.8, seed=7, n=2)
    choice = stopped.choices[0]
    return [choice.text, choice.finish_reason, choice.logprobs.tokens, choice.logprobs.token_logprobs,
            structured.choices[0].message.content, [c.text for c in sampled.choices]]


def _same(got: list, want: list) -> None:
    assert got[:3] == want[:3] and got[4:] == want[4:]
    assert got[3] == pytest.approx(want[3], abs=1e-3)  # (the prompt's KV computed in another batch)


def _at_rest(mesh: Mesh) -> dict[str, float]:
    deadline = time.monotonic() + 30
    while True:
        metrics = mesh.metrics()
        if metrics["myvllm:num_requests_running"] == 0 and metrics["myvllm:kv_cache_usage_perc"] == 0:
            return metrics
        assert time.monotonic() < deadline, metrics
        time.sleep(0.25)


def _transfers(mesh: Mesh) -> tuple[float, float, float]:
    text = mesh.metrics()
    return text["myvllm:kv_transfer_saves_total"], text["myvllm:kv_transfer_loads_total"], \
        text["myvllm:kv_transfer_load_failures_total"]


def _remote_prefills(mesh: Mesh) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(f"{mesh.base_url}/metrics", timeout=5).text.splitlines():
        m = re.match(r'myvllm:remote_prefills_total\{.*outcome="(\w+)".*\} (\S+)', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_prefill_and_decode_replicas_answer_like_one_replica_and_survive_either_worker_dying(
        smollm2_dir: str, cpu_hogs: CpuHogs) -> None:
    colocated = Mesh(["--model", smollm2_dir, *FLAGS])
    try:
        client = openai.OpenAI(base_url=f"{colocated.base_url}/v1", api_key="none", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        want = _texts(client, model, PROMPTS, stream=False)
        want_fresh = _texts(client, model, FRESH, stream=False)
        want_chat = _chat(client, model)
        want_features = _features(client, model)
    finally:
        assert colocated.stop() == 0
    assert all(want) and all(want_fresh)

    # (Every prompt here is short: all of them go through a prefill replica.)
    mesh = Mesh(["--model", smollm2_dir, *FLAGS, "--prefill-replicas", "1", "--decode-replicas", "1",
                 "--routing-remote-prefill-min-tokens", "0"],
                one_replica=False)
    try:
        assert "1 prefill + 1 decode" in "".join(mesh.banner)
        client = openai.OpenAI(base_url=f"{mesh.base_url}/v1", api_key="none", max_retries=0, timeout=300)
        assert _texts(client, model, PROMPTS, stream=True) == want
        assert _chat(client, model) == want_chat
        saves, loads, failures = _transfers(mesh)
        assert loads == saves == len(PROMPTS) + 1 and failures == 0, _transfers(mesh)
        assert _remote_prefills(mesh)["transferred"] == len(PROMPTS) + 1
        _same(_features(client, model), want_features)
        saves, loads, failures = _transfers(mesh)
        assert loads == saves == len(PROMPTS) + 4 and failures == 0
        # The same prompts again: the decode replica has them cached, nothing moves.
        assert _texts(client, model, PROMPTS, stream=False) == want
        assert _transfers(mesh) == (saves, loads, failures)
        _at_rest(mesh)

        # kill -9 of the prefill replica's worker with every new prompt's prefill in flight there
        # (the worker stopped first, so that all of them are).
        cpu_hogs.start()
        worker = int(re.findall(r"started worker-0 \(pid (\d+)\)", "".join(mesh.output))[-1])
        os.kill(worker, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(1) as pool:
                got = pool.submit(_texts, client, model, FRESH, True)
                deadline = time.monotonic() + 60
                while True:
                    metrics = mesh.metrics()
                    if metrics["myvllm:num_requests_running"] + metrics["myvllm:num_requests_waiting"] >= len(FRESH):
                        break
                    assert time.monotonic() < deadline, metrics
                    time.sleep(0.05)
                started = time.monotonic()
                os.kill(worker, signal.SIGKILL)
                texts = got.result(timeout=300)
                took = time.monotonic() - started
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
        outcomes = _remote_prefills(mesh)
        print(f"prefill worker kill -9 with {len(FRESH)} prefills in flight: every stream done {took:.1f} s after "
              f"the kill; remote prefills {outcomes}")
        assert texts == want_fresh
        assert outcomes["failed"] >= 1
        _at_rest(mesh)

        # kill -9 of the decode replica's worker mid-stream: the streams migrate (to the prefill
        # replica, a whole engine, while the decode replica restarts) and end with the same text.
        migrations = mesh.metrics()["myvllm:request_migrations_total"]
        first_tokens = threading.Barrier(len(PROMPTS) + 1)
        with ThreadPoolExecutor(1) as pool:
            got = pool.submit(_texts, client, model, PROMPTS, True, first_tokens)
            first_tokens.wait(timeout=120)
            os.kill(int(re.findall(r"started worker-1 \(pid (\d+)\)", "".join(mesh.output))[-1]), signal.SIGKILL)
            assert got.result(timeout=300) == want
        cpu_hogs.stop()
        assert mesh.metrics()["myvllm:request_migrations_total"] >= migrations + len(PROMPTS)
        _at_rest(mesh)
        assert mesh.proc.poll() is None  # serve went on (and restarts the worker)
    finally:
        assert mesh.stop() == 0
        assert mesh.leftovers == []
