"""Returned logprobs / top logprobs equal HF transformers' log_softmax (fp32, within 1e-4)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from support.hf_reference import hf_logprobs

from services.offline import LLM, SamplingParams

TOL = 1e-4
K = 5


@pytest.fixture(scope="module")
def llm(smollm2_dir: str) -> Iterator[LLM]:
    with LLM(smollm2_dir, seed=0, dtype="float32") as llm:
        yield llm


@pytest.mark.parametrize("prompt", ["The capital of France is", "def fibonacci(n):"])
def test_logprobs_match_hf(llm: LLM, smollm2_dir: str, prompt: str) -> None:
    (result,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, logprobs=K, ignore_eos=True),
                             use_tqdm=False)
    out = result.outputs[0]
    assert len(out.token_ids) == 8 and len(out.logprobs) == 8
    ref = hf_logprobs(smollm2_dir, result.prompt_token_ids + out.token_ids)
    n_prompt = len(result.prompt_token_ids)
    cumulative = 0.0
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[n_prompt - 1 + i]  # the distribution of generated token i
        # greedy: the sampled token is HF's argmax (rank 1) and its logprob matches
        assert tok == int(row.argmax()), f"step {i}"
        assert entry[tok].rank == 1
        assert entry[tok].logprob == pytest.approx(float(row[tok]), abs=TOL)
        cumulative += entry[tok].logprob
        # the top-k: HF's top-k ids with their logprobs, ranks 1..k
        top = sorted(((t, lp) for t, lp in entry.items()), key=lambda kv: kv[1].rank)
        assert len(entry) == K  # the sampled (argmax) token is one of the top k
        assert [lp.rank for _, lp in top] == list(range(1, K + 1))
        ref_lp, ref_ids = row.topk(K)
        got_lp = torch.tensor([lp.logprob for _, lp in top])
        torch.testing.assert_close(got_lp, ref_lp, atol=TOL, rtol=0)
        for t, lp in top:
            assert lp.logprob == pytest.approx(float(row[t]), abs=TOL), f"step {i} token {t}"
        # ids agree except where two logprobs tie within the tolerance
        for (t, _), rt, rlp in zip(top, ref_ids.tolist(), ref_lp.tolist(), strict=True):
            assert t == rt or abs(float(row[t]) - rlp) < TOL, f"step {i}: top id {t} vs HF {rt}"
    assert out.cumulative_logprob == pytest.approx(cumulative, abs=1e-5)


def test_sampled_logprobs_and_rank_match_hf(llm: LLM, smollm2_dir: str) -> None:
    """A sampled (non-greedy) token: its own logprob and rank come from the raw distribution."""
    (result,) = llm.generate("Once upon a time", SamplingParams(temperature=1.5, seed=3, max_tokens=8, logprobs=2,
                                                                ignore_eos=True), use_tqdm=False)
    out = result.outputs[0]
    ref = hf_logprobs(smollm2_dir, result.prompt_token_ids + out.token_ids)
    n_prompt = len(result.prompt_token_ids)
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[n_prompt - 1 + i]
        assert entry[tok].logprob == pytest.approx(float(row[tok]), abs=TOL)
        hf_rank = int((row > row[tok] + TOL).sum()) + 1
        assert hf_rank <= entry[tok].rank <= int((row > row[tok] - TOL).sum()) + 1, f"step {i}"
        assert len(entry) in (2, 3)
