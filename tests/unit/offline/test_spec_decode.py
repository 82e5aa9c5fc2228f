"""Speculative decoding end to end in the offline `LLM`: greedy outputs token-identical with it on
and off (the HF-equality prompt set, under chunked prefill, preemption and prefix caching,
every block free afterwards), and random sampling that keeps the target's distribution
(two-sample chi-square of the tokens verification produces, with and without drafts)."""

from __future__ import annotations

import gc
from collections import Counter

import pytest
from support.spec_stats import two_sample
from test_hf_equality import BLOCK_SIZE, _engine_args, _prompts

from services.common.sampling_params import SamplingParams
from services.offline.llm import LLM

MAX_NEW_TOKENS = 48
# disable_by_batch_size 0: these tests run many requests at once and want drafts for all of them.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_batch_size": 0}


def _generate(model_dir: str, prompts: list[list[int]], params: SamplingParams, **engine_args):
    llm = LLM(model_dir, seed=0, dtype="float32", block_size=BLOCK_SIZE, **engine_args)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], llm.stats()
    finally:
        llm.close()
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def baseline(tiny_qwen3_dir: str) -> list[list[int]]:
    prompts, _ = _prompts("tiny_qwen3")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    return _generate(tiny_qwen3_dir, prompts, params)[0]


CASES = [("ngram", c) for c in ("defaults", "chunked", "preemption", "prefix", "tp2")] + [
    ("draft_model", "chunked"), ("draft_model", "preemption"), ("self_draft", "defaults")]


def _spec_config(method: str, target_dir: str, draft_dir: str) -> dict:
    if method == "ngram":
        return NGRAM
    # A tiny random draft (another architecture, same tokenizer), or the target drafting for
    # itself: then every draft must be accepted, which checks the draft's own KV cache.
    return {"method": "draft_model", "model": target_dir if method == "self_draft" else draft_dir,
            "num_speculative_tokens": 3, "disable_by_batch_size": 0}


@pytest.mark.parametrize(("method", "config"), CASES)
def test_greedy_identical_with_speculation(tiny_qwen3_dir: str, tiny_llama_dir: str, baseline: list[list[int]],
                                           method: str, config: str) -> None:
    prompts, shared_idx = _prompts("tiny_qwen3")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    # tp2: two tensor-parallel ranks, rank 0's verified tokens broadcast to the other.
    args = {"tensor_parallel_size": 2} if config == "tp2" else _engine_args(config, prompts, len(shared_idx))
    if config == "preemption" and method != "ngram":
        # The draft's lookahead slots (k per request) count against the pool too.
        args["num_gpu_blocks_override"] += 4
    if config == "prefix":
        # The shared prefix is cached by an earlier request of the same engine.
        prompts = [prompts[shared_idx[0]]] + prompts
    spec = _spec_config(method, tiny_qwen3_dir, tiny_llama_dir)
    got, stats = _generate(tiny_qwen3_dir, prompts, params, speculative_config=spec, **args)
    if config == "prefix":
        got = got[1:]
        assert stats["prefix_cache_hits"] > 0
    mismatches = [i for i, (g, e) in enumerate(zip(got, baseline, strict=True)) if g != e]
    assert not mismatches, f"prompts {mismatches} differ with speculation"
    assert stats["spec_decode_num_draft_tokens"] > 0, stats
    if method == "self_draft":
        assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"], stats
    elif method == "ngram":
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert (stats["num_preemptions"] > 0) == (config == "preemption"), stats


# The test's token set: a logit bias confines sampling to it, and the prompt cycles through it, so
# whatever the first token, the n-gram proposer finds it in the prompt and drafts its followers
# (which the model assigns real probability: drafts are accepted sometimes, refused sometimes).
ALPHABET = [1000 + 37 * i for i in range(8)]


DRAWS = 3000
DIST_PARAMS = SamplingParams(temperature=8.0, top_k=8, max_tokens=4, ignore_eos=True,
                             logit_bias={t: 100.0 for t in ALPHABET})
DIST_PROMPT = [3000 + 11 * i for i in range(10)] + ALPHABET + ALPHABET[::-1] + ALPHABET[::2] + ALPHABET[1::2]


# Requests per step: verification works on [requests, positions, vocab] fp32 tensors (3 x 49,152
# floats a request). At 48 requests each stays under glibc's 32 MiB mmap threshold, so the
# process reuses its memory instead of mapping and zero-filling fresh pages for every tensor
# (at 256 requests each tensor is ~150 MB, and faulting it in again for every draw is slow). The
# draws, their number and the test's statistics do not depend on how they are batched.
DRAW_BATCH = 48


def _draw(model_dir: str, spec: dict | None) -> tuple[list[tuple[int, ...]], dict]:
    llm = LLM(model_dir, seed=0, dtype="float32", block_size=BLOCK_SIZE, max_num_seqs=DRAW_BATCH,
              max_num_batched_tokens=4096, speculative_config=spec)
    try:
        outs = llm.generate([{"prompt_token_ids": DIST_PROMPT}] * DRAWS, DIST_PARAMS, use_tqdm=False)
        return [tuple(o.outputs[0].token_ids) for o in outs], llm.stats()
    finally:
        llm.close()


@pytest.fixture(scope="module")
def draws_without_drafts(tiny_llama_dir: str) -> list[tuple[int, ...]]:
    return _draw(tiny_llama_dir, None)[0]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_random_sampling_keeps_the_target_distribution(tiny_llama_dir: str, tiny_qwen3_dir: str,
                                                       draws_without_drafts: list, method: str) -> None:
    """First and second verified tokens (outputs 2 and 3: output 1 comes from the prefill, which
    has no drafts) of several thousand draws, with and without drafts (n-gram: point masses;
    a tiny random draft model: its own processed distribution)."""
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": tiny_qwen3_dir,
                                            "num_speculative_tokens": 2, "disable_by_batch_size": 0}
    on, stats = _draw(tiny_llama_dir, spec)
    off = draws_without_drafts
    assert stats["spec_decode_num_accepted_tokens"] > 100, stats
    assert stats["spec_decode_num_draft_tokens"] - stats["spec_decode_num_accepted_tokens"] > 100, stats
    for position in (1, 2):
        a, b = Counter(s[position] for s in off), Counter(s[position] for s in on)
        assert len(a) > 2  # a distribution worth testing, not one token
        p = two_sample(a, b)
        assert p > 0.001, (position, p, a.most_common(8), b.most_common(8))
    assert two_sample(Counter(s[1:3] for s in off), Counter(s[1:3] for s in on)) > 0.001


def test_mixed_batch_penalties_seeds_logprobs_min_tokens(tiny_qwen3_dir: str) -> None:
    """Requests that may not speculate (penalties, a seed, min_tokens not reached yet) share steps
    with speculating ones: every output, and every logprob, is what it is without speculation."""
    prompt = [5000 + 7 * i for i in range(60)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=7, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=24, min_tokens=10, logprobs=0)]
    results = {}
    # The target drafting for itself: greedy drafts are all accepted, several tokens per step.
    self_draft = _spec_config("self_draft", tiny_qwen3_dir, "")
    for name, spec in (("off", None), ("on", self_draft)):
        llm = LLM(tiny_qwen3_dir, seed=0, dtype="float32", block_size=BLOCK_SIZE, speculative_config=spec)
        try:
            outs = llm.generate([{"prompt_token_ids": prompt}] * len(params), params, use_tqdm=False)
            results[name] = [o.outputs[0] for o in outs]
            stats = llm.stats()
        finally:
            llm.close()
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats
    for i, (off, on) in enumerate(zip(results["off"], results["on"], strict=True)):
        assert on.token_ids == off.token_ids, i
        if off.logprobs is not None:
            assert len(on.logprobs) == len(off.logprobs)
            for a, b in zip(off.logprobs, on.logprobs, strict=True):
                assert a.keys() == b.keys(), i
                assert all(abs(a[t].logprob - b[t].logprob) < 1e-3 and a[t].rank == b[t].rank for t in a), i
