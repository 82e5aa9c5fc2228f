"""Speculative decoding through the real mesh (`myvllm serve --speculative-config`, with async
scheduling: each step verifies the worker's own drafts of the step still in flight, over real
gRPC), with the official `openai` client: greedy text equal to the offline engine's without
drafts, several tokens per streamed chunk, the spec_decode counters on /metrics, and a clear
refusal of a bad configuration at start-up."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from openai import OpenAI
from support.mesh import REPO, Mesh

from services.offline import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
# A prompt the model partly repeats: the n-gram proposer's home ground.
PROMPT = ("Rewrite the paragraph, changing only the names.\n\nParagraph: Alice went to the market on Monday "
          "to buy apples, bread and milk. Alice met Bob there, and Bob told Alice about his new garden.\n\n"
          "Rewritten: Carol went to the market on Monday to buy apples, bread and milk.")


@pytest.fixture(scope="module")
def mesh(smollm2_dir: str):
    m = Mesh(["--model", smollm2_dir, "--max-model-len", "1024", "--kv-cache-memory", str(64 << 20),
              "--speculative-config", json.dumps(SPEC), "--async-scheduling"])
    yield m
    assert m.stop() == 0, "serve did not stop cleanly on Ctrl-C"


def _offline(smollm2_dir: str, **engine_args):
    llm = LLM(smollm2_dir, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20, **engine_args)
    try:
        return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)[0].outputs[0]
    finally:
        llm.close()


def test_stream_is_offline_greedy_with_several_tokens_per_chunk(mesh: Mesh, smollm2_dir: str) -> None:
    """The mesh with drafts answers what the offline LLM answers with the same drafts, and that
    is the text without any."""
    expected = _offline(smollm2_dir)
    assert _offline(smollm2_dir, speculative_config=SPEC).text == expected.text
    client = OpenAI(base_url=f"{mesh.base_url}/v1", api_key="none")
    model = client.models.list().data[0].id
    reply = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=48)
    assert reply.choices[0].text == expected.text
    assert reply.usage.completion_tokens == len(expected.token_ids)
    stream = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=48, stream=True,
                                       logprobs=0)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == expected.text
    tokens_per_chunk = [len(c.logprobs.tokens) for c in chunks if c.logprobs is not None]
    assert sum(tokens_per_chunk) == len(expected.token_ids)
    assert max(tokens_per_chunk) > 1, tokens_per_chunk  # accepted drafts arrive with their step
    metrics = mesh.metrics()
    accepted = metrics["myvllm:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= metrics["myvllm:spec_decode_num_draft_tokens_total"]
    assert metrics["vllm:spec_decode_num_accepted_tokens_total"] == accepted  # vLLM's name, for its dashboards


def test_serve_refuses_a_bad_speculative_config() -> None:
    proc = subprocess.run([sys.executable, "-m", "services.entrypoints.cli", "serve", "--speculative-config",
                           '{"method": "ngram", "num_speculative_tokens": 0}'],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "num_speculative_tokens" in proc.stderr + proc.stdout
