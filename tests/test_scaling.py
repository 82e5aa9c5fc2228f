"""Scaling out with real processes: `myvllm serve --data-parallel-size 2 --tensor-parallel-size 2`
(an embedded redis-server, two replicas of one scheduler and two worker ranks each over gloo,
one gateway discovering them), driven by the official `openai` client.

Greedy text through the cluster equals HF transformers' on the same weights, requests land on
both replicas (the gateway's per-replica counter), and every replica frees every block."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hf_reference import hf_greedy
from mesh import Mesh

from services.common.sampling_params import SamplingParams
from services.sdk.llm import LLM

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(tiny_qwen2_dir: str):
    mesh = Mesh(["--model", tiny_qwen2_dir, "--dtype", "float32", "--data-parallel-size", "2",
                 "--tensor-parallel-size", "2", "--max-model-len", "512", "--kv-cache-memory", str(32 << 20)],
                env={"MYVLLM_NUM_THREADS": "1"}, one_replica=False)
    yield mesh
    mesh.stop()


def _routed(metrics_text: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^myvllm:replica_requests_total\{[^}]*replica="([^"]+)"[^}]*\} (\S+)$', metrics_text, re.M)}


def test_serve_data_and_tensor_parallel_answers_openai_like_hf(cluster: Mesh, tiny_qwen2_dir: str) -> None:
    from openai import OpenAI

    assert any(line.startswith("topology: 2 engine replicas") for line in cluster.banner), cluster.banner
    prompts = [[5 + i, 900 + 7 * i, 4000 + i, 33, 2000 + 11 * i] for i in range(8)]
    want = hf_greedy(tiny_qwen2_dir, prompts, MAX_TOKENS)
    client = OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none")
    model = client.models.list().data[0].id

    # The same ids as text, through the offline engine's detokenizer (the gateway's own pipeline).
    llm = LLM(tiny_qwen2_dir, dtype="float32", max_model_len=512, kv_cache_memory_bytes=32 << 20)
    offline = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in offline] == want
    want_text = [o.outputs[0].text for o in offline]

    def complete(prompt: list[int]) -> str:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
        return reply.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(complete, prompts))
    assert got == want_text

    routed = _routed(httpx.get(f"{cluster.base_url}/metrics", timeout=5).text)
    assert len(routed) == 2 and all(count >= 1 for count in routed.values()), routed
    assert sum(routed.values()) >= len(prompts)
    metrics = cluster.metrics()  # summed over the replicas
    assert metrics["myvllm:num_requests_running"] == 0 and metrics["myvllm:kv_cache_usage_perc"] == 0
