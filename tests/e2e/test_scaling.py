"""Scaling out with real processes: `myvllm serve --data-parallel-size 2 --tensor-parallel-size 2
--pipeline-parallel-size 2` (an embedded redis-server, two replicas of one scheduler and four
worker ranks each over gloo: two stages of two tensor-parallel ranks, one gateway discovering
them), driven by the official `openai` client.

Greedy text through the cluster equals the offline `LLM`'s on the same parallel layout (and HF
transformers' token ids), a constrained (structured-outputs) request included; requests land on
both replicas (the gateway's per-replica counter), and every replica frees every block."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import pytest
from support.hf_reference import hf_greedy
from support.mesh import Mesh

from services.common.redis_registry import ENGINES_KEY, REDIS_URL_ENV
from services.common.sampling_params import SamplingParams
from services.common.structured_outputs import StructuredOutputsParams
from services.offline.llm import LLM

MAX_TOKENS = 12
PROMPTS = [[5 + i, 900 + 7 * i, 4000 + i, 33, 2000 + 11 * i] for i in range(8)]
# Masked at every step (a regex, not a single choice): each step's bitmask crosses the stages.
CONSTRAINT = {"regex": "[a-z]{2,6}( [a-z]{2,6}){1,5}"}


@pytest.fixture(scope="module")
def offline(tiny_qwen2_dir: str) -> dict:
    """The offline LLM's greedy answers on the cluster's layout (2 tensor-parallel ranks x 2
    pipeline stages, spawned ranks), computed before the cluster starts: close() joins the ranks,
    so the two never hold memory at once."""
    llm = LLM(tiny_qwen2_dir, dtype="float32", tensor_parallel_size=2, pipeline_parallel_size=2, max_model_len=512,
              kv_cache_memory_bytes=32 << 20)
    try:
        plain = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                             SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
        constrained = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(**CONSTRAINT)),
            use_tqdm=False)
    finally:
        llm.close()
    return {"token_ids": [list(o.outputs[0].token_ids) for o in plain], "text": [o.outputs[0].text for o in plain],
            "constrained": constrained[0].outputs[0].text}


@pytest.fixture(scope="module")
def cluster(offline: dict, tiny_qwen2_dir: str):
    mesh = Mesh(["--model", tiny_qwen2_dir, "--dtype", "float32", "--data-parallel-size", "2",
                 "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--max-model-len", "512",
                 "--kv-cache-memory", str(32 << 20)],
                env={"MYVLLM_NUM_THREADS": "1"}, one_replica=False)
    yield mesh
    mesh.stop()


def _routed(metrics_text: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^myvllm:replica_requests_total\{[^}]*replica="([^"]+)"[^}]*\} (\S+)$', metrics_text, re.M)}


def _complete_all(cluster: Mesh, prompts: list[list[int]]) -> list[str]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id

    def complete(prompt: list[int]) -> str:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
        return reply.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(complete, prompts))


def test_serve_data_tensor_and_pipeline_parallel_answers_like_the_offline_llm_and_hf(
        cluster: Mesh, offline: dict, tiny_qwen2_dir: str) -> None:
    assert any(line.startswith("topology: 2 engine replicas (data parallel), 4 worker ranks each (2 tensor "
                               "parallel x 2 pipeline stages)") for line in cluster.banner), cluster.banner
    prompts = PROMPTS
    assert offline["token_ids"] == hf_greedy(tiny_qwen2_dir, prompts, MAX_TOKENS)
    assert _complete_all(cluster, prompts) == offline["text"]  # the same ids, through the gateway's detokenizer

    from openai import OpenAI

    client = OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0)
    reply = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[0], temperature=0,
                                      max_tokens=MAX_TOKENS, extra_body={"structured_outputs": CONSTRAINT})
    assert reply.choices[0].text == offline["constrained"]
    assert re.fullmatch(CONSTRAINT["regex"], offline["constrained"]) or reply.choices[0].finish_reason == "length"

    routed = _routed(httpx.get(f"{cluster.base_url}/metrics", timeout=5).text)
    assert len(routed) == 2 and all(count >= 1 for count in routed.values()), routed
    assert sum(routed.values()) >= len(prompts)
    metrics = cluster.metrics()  # summed over the replicas
    assert metrics["myvllm:num_requests_running"] == 0 and metrics["myvllm:kv_cache_usage_perc"] == 0


def _children(parent_pid: int) -> dict[int, list[str]]:
    """pid -> command line of every process `parent_pid` started."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline") as f:
                cmdline = f.read().split("\0")
        except OSError:
            continue
        if ppid == parent_pid:
            found[int(entry)] = cmdline
    return found


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = f.read().decode(errors="replace").split("\0")
    except OSError:
        return {}
    return dict(pair.split("=", 1) for pair in pairs if "=" in pair)


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_killed_rank_fails_over_and_its_replica_comes_back(cluster: Mesh, offline: dict) -> None:
    """kill -9 of one worker rank (the last stage's second TP rank) of replica 1: the replica
    leaves redis, requests are answered right by the other one meanwhile; serve restarts the
    rank, the scheduler sets all four ranks up again as a new process group, the replica
    rejoins and answers right again. (And serve's redis refuses a client without its password.)"""
    import redis

    want_text = offline["text"]
    port = int(re.search(r"redis on 127\.0\.0\.1:(\d+)", "".join(cluster.banner)).group(1))
    services = _children(cluster.proc.pid)
    # serve's redis-server wants the password serve made for it, which only its schedulers and
    # gateway know (their environment): not in any command line, not in serve's output.
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=port).hget(ENGINES_KEY, "replica-1")
    url = {pid: _environ(pid).get(REDIS_URL_ENV) for pid, cmd in services.items() if "scheduler" in cmd}
    assert len(url) == 2 and len(set(url.values())) == 1, url
    url = next(iter(url.values()))
    password = urlsplit(url).password
    assert password and len(password) >= 32 and urlsplit(url).port == port
    assert not any(password in arg for cmd in services.values() for arg in cmd)
    assert password not in "".join(cluster.output)
    assert not any(REDIS_URL_ENV in _environ(pid) for pid, cmd in services.items() if "worker" in cmd)
    engines = redis.Redis.from_url(url)
    assert "mac" in json.loads(engines.hget(ENGINES_KEY, "replica-1"))  # signed with serve's internal token
    scheduler = next(cmd for cmd in services.values() if "scheduler" in cmd and "replica-1" in cmd)
    last_rank_port = scheduler[scheduler.index("--workers") + 1].split(",")[-1].rpartition(":")[2]
    victim = next(pid for pid, cmd in services.items() if "worker" in cmd and cmd[cmd.index("--port") + 1]
                  == last_rank_port)
    address = f"127.0.0.1:{scheduler[scheduler.index('--port') + 1]}"  # the gateway's label for replica 1
    os.kill(victim, signal.SIGKILL)
    _wait_for(lambda: engines.hget(ENGINES_KEY, "replica-1") is None, 30, "replica 1 to leave redis")
    assert _complete_all(cluster, PROMPTS) == want_text  # replica 0 alone, meanwhile
    _wait_for(lambda: engines.hget(ENGINES_KEY, "replica-1") is not None, 120, "replica 1 to rejoin")
    before = _routed(httpx.get(f"{cluster.base_url}/metrics", timeout=5).text)[address]
    assert _complete_all(cluster, PROMPTS) == want_text
    assert _routed(httpx.get(f"{cluster.base_url}/metrics", timeout=5).text)[address] > before
    metrics = cluster.metrics()
    assert metrics["myvllm:num_requests_running"] == 0 and metrics["myvllm:kv_cache_usage_perc"] == 0
