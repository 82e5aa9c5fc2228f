"""Tensor parallelism: how the model splits across ranks, and greedy output equal to HF
transformers with the ranks running as real processes over gloo.

fp32, the equality test's kind of prompts (random ids, one of them long enough for several
blocks). An all-reduce sums the row-parallel partial products in another order than one
matmul does, so a near-tie between the top two logits could flip; the tiny models' sharpened
logits (conftest) keep such ties out of these prompts, and no difference is tolerated here.
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
from support.hf_reference import hf_greedy

from services.common.parallel_shapes import check_tensor_parallel_shapes
from services.common.sampling_params import SamplingParams
from services.offline.llm import LLM
from services.worker.parallel import TensorParallel, head_range, kv_head_range, vocab_range

MAX_NEW_TOKENS = 24


def _config(heads: int = 9, kv_heads: int = 3, intermediate: int = 1536):
    return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate)


def test_shapes_a_tp_size_does_not_divide_are_refused_with_the_numbers() -> None:
    check_tensor_parallel_shapes(_config(), 3)  # SmolLM2: 9 heads, 3 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide num_attention_heads=9"):
        check_tensor_parallel_shapes(_config(), 2)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        check_tensor_parallel_shapes(_config(heads=12, kv_heads=3), 4)
    with pytest.raises(ValueError, match="intermediate_size=1000"):
        check_tensor_parallel_shapes(_config(heads=6, kv_heads=3, intermediate=1000), 3)


def test_each_rank_gets_its_heads_and_a_replicated_kv_head_when_there_are_fewer() -> None:
    assert [head_range(9, TensorParallel(r, 3)) for r in range(3)] == [(0, 3), (3, 3), (6, 3)]
    assert [kv_head_range(3, TensorParallel(r, 3)) for r in range(3)] == [(0, 1), (1, 1), (2, 1)]
    # 4 ranks, 2 KV heads: ranks 0-1 share KV head 0, ranks 2-3 KV head 1, matching their query heads
    assert [kv_head_range(2, TensorParallel(r, 4)) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    group = 4 // 2
    for r in range(4):
        first_q, _ = head_range(4, TensorParallel(r, 4))
        assert first_q // group == kv_head_range(2, TensorParallel(r, 4))[0]
    # An uneven vocabulary: equal-sized shards, the last one padded
    assert [vocab_range(10, TensorParallel(r, 3)) for r in range(3)] == [(0, 4), (4, 4), (8, 4)]


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 7, 40, 150)]


def _tp_greedy(model_dir: str, tp: int, prompts: list[list[int]], **engine_args) -> list[list[int]]:
    llm = LLM(model_dir, dtype="float32", tensor_parallel_size=tp, seed=0, **engine_args)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]  # every block back
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.close()


@pytest.mark.parametrize(("arch", "tp"), [("qwen2", 2), ("qwen3", 2), ("qwen2", 4)])
def test_tensor_parallel_greedy_equals_hf(tiny_model_dir, arch: str, tp: int) -> None:
    """qwen2: q/k/v biases, untied LM head, sharded checkpoint; qwen3: q/k norms, tied
    embeddings (the vocab-parallel embedding is the LM head); TP=4 over 2 KV heads replicates
    each KV head on two ranks. Chunked prefill (budget 32) mixes prefill chunks with decodes."""
    model_dir = tiny_model_dir(arch)
    prompts = _prompts()
    want = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    assert _tp_greedy(model_dir, tp, prompts, max_num_batched_tokens=32) == want


def test_tensor_parallel_3_on_smollm2_equals_hf(smollm2_dir: str) -> None:
    """The default model: 9 query heads and 3 KV heads over 3 ranks (one KV head each), tied
    embeddings split in three 16,384-row shards."""
    prompts = _prompts()[:3]
    want = hf_greedy(smollm2_dir, prompts, MAX_NEW_TOKENS)
    assert _tp_greedy(smollm2_dir, 3, prompts) == want


def test_a_tp_size_the_model_cannot_split_is_refused(smollm2_dir: str) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide num_attention_heads=9"):
        LLM(smollm2_dir, dtype="float32", tensor_parallel_size=2)


def test_a_dead_rank_is_a_clear_error_not_a_hang(tiny_qwen2_dir: str) -> None:
    """kill -9 of a rank process: the next step fails with an error naming tensor parallelism
    (gloo sees the closed connection) instead of waiting in a collective."""
    llm = LLM(tiny_qwen2_dir, dtype="float32", tensor_parallel_size=2)
    try:
        llm.worker.procs[0].kill()
        llm.worker.procs[0].join(timeout=10)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="tensor-parallel|Connection|connection"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - started < 60
    finally:
        llm.close()
