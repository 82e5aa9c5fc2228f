"""Speculative decoding end to end in the offline `LLM`: greedy outputs token-identical with it on
and off (the HF-equality prompt set, under chunked prefill, preemption and prefix caching,
every block free afterwards), and random sampling that keeps the target's distribution
(two-sample chi-square of the tokens verification produces, with and without drafts)."""

from __future__ import annotations

import gc
from collections import Counter

import pytest
from spec_stats import two_sample
from test_hf_equality import BLOCK_SIZE, _engine_args, _prompts

from services.common.sampling_params import SamplingParams
from services.sdk.llm import LLM

MAX_NEW_TOKENS = 48
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


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


@pytest.mark.parametrize("config", ["defaults", "chunked", "preemption", "prefix"])
def test_greedy_identical_with_ngram_speculation(tiny_qwen3_dir: str, baseline: list[list[int]], config: str) -> None:
    prompts, shared_idx = _prompts("tiny_qwen3")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    args = _engine_args(config, prompts, len(shared_idx))
    if config == "prefix":
        # The shared prefix is cached by an earlier request of the same engine.
        prompts = [prompts[shared_idx[0]]] + prompts
    got, stats = _generate(tiny_qwen3_dir, prompts, params, speculative_config=NGRAM, **args)
    if config == "prefix":
        got = got[1:]
        assert stats["prefix_cache_hits"] > 0
    mismatches = [i for i, (g, e) in enumerate(zip(got, baseline, strict=True)) if g != e]
    assert not mismatches, f"prompts {mismatches} differ with speculation"
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"], stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert (stats["num_preemptions"] > 0) == (config == "preemption"), stats


# The test's token set: a logit bias confines sampling to it, and the prompt cycles through it, so
# whatever the first token, the n-gram proposer finds it in the prompt and drafts its followers
# (which the model assigns real probability: drafts are accepted sometimes, refused sometimes).
ALPHABET = [1000 + 37 * i for i in range(8)]


def test_random_sampling_keeps_the_target_distribution(tiny_llama_dir: str) -> None:
    """First and second verified tokens (outputs 2 and 3: output 1 comes from the prefill, which
    has no drafts) of several thousand draws, with and without n-gram drafts."""
    draws = 3000
    params = SamplingParams(temperature=8.0, top_k=8, max_tokens=4, ignore_eos=True,
                            logit_bias={t: 100.0 for t in ALPHABET})
    prompt = [3000 + 11 * i for i in range(10)] + ALPHABET + ALPHABET[::-1] + ALPHABET[::2] + ALPHABET[1::2]
    samples = {}
    for name, spec in (("off", None), ("on", NGRAM)):
        llm = LLM(tiny_llama_dir, seed=0, dtype="float32", block_size=BLOCK_SIZE, max_num_seqs=256,
                  max_num_batched_tokens=4096, speculative_config=spec)
        try:
            outs = llm.generate([{"prompt_token_ids": prompt}] * draws, params, use_tqdm=False)
            samples[name] = [tuple(o.outputs[0].token_ids) for o in outs]
            stats = llm.stats()
        finally:
            llm.close()
    assert stats["spec_decode_num_accepted_tokens"] > 100, stats
    assert stats["spec_decode_num_draft_tokens"] - stats["spec_decode_num_accepted_tokens"] > 100, stats
    for position in (1, 2):
        off = Counter(s[position] for s in samples["off"])
        on = Counter(s[position] for s in samples["on"])
        assert len(off) > 2  # a distribution worth testing, not one token
        p = two_sample(off, on)
        assert p > 0.001, (position, p, off.most_common(8), on.most_common(8))
    pairs_p = two_sample(Counter(s[1:] for s in samples["off"]), Counter(s[1:] for s in samples["on"]))
    assert pairs_p > 0.001, pairs_p
