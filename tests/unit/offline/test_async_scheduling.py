"""Async scheduling (two steps in flight, output placeholders) gives the same greedy tokens."""

from __future__ import annotations

import random

import pytest

from services.offline import LLM, SamplingParams

CONFIGS = {
    "defaults": {},
    "chunked_prefill": {"max_num_batched_tokens": 32},
    "preemption": {"num_gpu_blocks_override": 26},
}


def _prompts() -> list[dict]:
    rng = random.Random(7)
    return [{"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(n)]} for n in (1, 5, 17, 40, 100, 300, 64)]


@pytest.mark.parametrize("config", CONFIGS)
def test_async_scheduling_matches_sync_greedy(smollm2_dir, config):
    kwargs = CONFIGS[config]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = {}
    for async_scheduling in (False, True):
        llm = LLM(smollm2_dir, dtype="float32", async_scheduling=async_scheduling, **kwargs)
        outputs = llm.generate(_prompts(), sp, use_tqdm=False)
        results[async_scheduling] = [o.outputs[0].token_ids for o in outputs]
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        if config == "preemption":
            assert stats["num_preemptions"] > 0
        assert all(len(ids) == 24 for ids in results[async_scheduling])
        llm.close()
    assert results[True] == results[False]


def test_async_scheduling_stops_on_eos_and_max_tokens(smollm2_dir):
    llm = LLM(smollm2_dir, dtype="float32", async_scheduling=True)
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and "Paris" in out.text
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    llm.close()
