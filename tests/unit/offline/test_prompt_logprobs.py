"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`) equal HF transformers' log_softmax
of the prompt, through chunked prefill, preemption, prefix-cache neighbours and n > 1."""

from __future__ import annotations

import pytest
import torch
from support.hf_reference import hf_logprobs

from services.offline import LLM, SamplingParams

TOL = 1e-4
K = 3


def _check_against_hf(model_dir: str, prompt_ids: list[int], prompt_logprobs: list, k: int) -> None:
    assert len(prompt_logprobs) == len(prompt_ids)
    assert prompt_logprobs[0] is None  # nothing comes before the first token
    ref = hf_logprobs(model_dir, prompt_ids)  # [n, vocab]: row p scores token p + 1
    for p in range(1, len(prompt_ids)):
        entry, row, token = prompt_logprobs[p], ref[p - 1], prompt_ids[p]
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=TOL), f"position {p}"
        hf_rank_lo = int((row > row[token] + TOL).sum()) + 1
        hf_rank_hi = int((row > row[token] - TOL).sum()) + 1
        assert hf_rank_lo <= entry[token].rank <= hf_rank_hi, f"position {p}"
        top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= k)
        ref_lp, _ = row.topk(k)
        torch.testing.assert_close(torch.tensor([lp for _, _, lp in top]), ref_lp, atol=TOL, rtol=0)
        assert len(entry) in (k, k + 1)  # the prompt token joins the top k unless it is in it


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    # Lengths around the chunk (32) and block (16) boundaries; the second shares a 40-token prefix
    # with the first, so without the bypass it would hit the prefix cache.
    base = [(7 * i + 3) % 4000 + 100 for i in range(70)]
    return [base, base[:40] + [(11 * i) % 3000 + 200 for i in range(23)], base[:1], base[:17]]


@pytest.mark.parametrize("engine", [
    {},                                               # defaults
    {"max_num_batched_tokens": 32},                   # prompts cut into chunks
    {"max_num_batched_tokens": 32, "num_gpu_blocks_override": 12, "max_num_seqs": 4},  # preemption
])
def test_prompt_logprobs_match_hf(smollm2_dir: str, prompts: list[list[int]], engine: dict) -> None:
    llm = LLM(smollm2_dir, seed=0, dtype="float32", **engine)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=K)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, result in zip(prompts, results, strict=True):
        _check_against_hf(smollm2_dir, prompt, result.prompt_logprobs, K)
        assert result.num_cached_tokens == 0  # every prompt position was computed, warm cache or not
    if "num_gpu_blocks_override" in engine:
        assert llm.stats()["num_preemptions"] > 0
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    llm.close()


def test_prompt_logprobs_with_n_and_without(smollm2_dir: str) -> None:
    llm = LLM(smollm2_dir, seed=0, dtype="float32")
    asked, plain = llm.generate(
        ["The capital of France is", "The capital of France is"],
        [SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=4, prompt_logprobs=0), SamplingParams(max_tokens=4)],
        use_tqdm=False)
    assert plain.prompt_logprobs is None
    assert len(asked.outputs) == 2
    ids = asked.prompt_token_ids
    _check_against_hf(smollm2_dir, ids, asked.prompt_logprobs, 0)
    assert all(len(entry) == 1 for entry in asked.prompt_logprobs[1:])  # k = 0: just the prompt token
    llm.close()


def test_prompt_logprobs_out_of_range_is_refused() -> None:
    from services.common.param_errors import SamplingParamsError

    with pytest.raises(SamplingParamsError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=-1)
