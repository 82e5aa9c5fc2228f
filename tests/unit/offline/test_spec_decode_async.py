"""Speculative decoding with async scheduling: step N+1 is scheduled while step N is in flight, so
it verifies the worker's own drafts (num_worker_drafts) from counts the scheduler only bounds.
Greedy outputs stay token-identical to speculation off, with every block free afterwards; and
the scheduler's bookkeeping of an in-flight step's drafts is checked step by step."""

from __future__ import annotations

import pytest
from support.schedulers import scheduler_for
from test_hf_equality import _engine_args, _prompts
from test_spec_decode import MAX_NEW_TOKENS, _generate, _spec_config

from services.common.proto import myvllm_pb2 as pb
from services.common.sampling_params import SamplingParams
from services.common.spec_config import SpeculativeConfig
from services.engine.request import Request


@pytest.fixture(scope="module")
def baseline(tiny_qwen3_dir: str) -> list[list[int]]:
    prompts, _ = _prompts("tiny_qwen3")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    return _generate(tiny_qwen3_dir, prompts, params)[0]


CASES = [("ngram", "defaults"), ("ngram", "chunked"), ("ngram", "preemption"), ("ngram", "tp2"),
         ("draft_model", "chunked"), ("self_draft", "defaults")]


@pytest.mark.parametrize(("method", "config"), CASES)
def test_greedy_identical_with_speculation_and_async_scheduling(
        tiny_qwen3_dir: str, tiny_llama_dir: str, baseline: list[list[int]], method: str, config: str) -> None:
    prompts, shared_idx = _prompts("tiny_qwen3")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    # tp2: both ranks verify their own drafts (n-gram drafts are the same on every rank).
    args = {"tensor_parallel_size": 2} if config == "tp2" else _engine_args(config, prompts, len(shared_idx))
    if config == "preemption" and method != "ngram":
        args["num_gpu_blocks_override"] += 4
    spec = _spec_config(method, tiny_qwen3_dir, tiny_llama_dir)
    got, stats = _generate(tiny_qwen3_dir, prompts, params, speculative_config=spec, async_scheduling=True, **args)
    mismatches = [i for i, (g, e) in enumerate(zip(got, baseline, strict=True)) if g != e]
    assert not mismatches, f"prompts {mismatches} differ with speculation and async scheduling"
    assert stats["spec_decode_num_draft_tokens"] > 0, stats
    if method == "self_draft":  # the target drafting for itself: every draft verified is accepted
        assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"], stats
    elif method == "ngram":  # (a random tiny draft model is rarely right about the random target)
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert (stats["num_preemptions"] > 0) == (config == "preemption"), stats


def test_the_scheduler_bounds_an_in_flight_steps_drafts_and_corrects_them_from_its_output() -> None:
    """Two steps in flight: N verifies 3 known drafts; N+1 is scheduled before N's output, with 3
    worker drafts and num_computed_tokens counting N's drafts as accepted; N accepts 1, and the
    scheduler's counts come back to the truth."""
    k, block_size = 3, 4
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": k})
    sched = scheduler_for(num_blocks=64, block_size=block_size, max_num_seqs=4, max_num_batched_tokens=64,
                      max_model_len=128, async_scheduling=True, speculative_config=spec)
    request = Request("r", [5, 6, 7, 8, 9], pb.SamplingParams(temperature=0.0, max_tokens=50),
                      eos_token_ids=frozenset(), max_tokens=50)
    sched.add_request(request)

    prefill = sched.schedule()
    assert list(prefill.num_scheduled_tokens) == [5] and request.num_output_placeholders == 1
    # The prefill's token is in flight: the next step verifies up to k drafts the worker will have.
    step1 = sched.schedule()
    (cached,) = step1.cached_requests
    assert (cached.num_worker_drafts, cached.drafts_in_flight, list(cached.spec_token_ids)) == (k, False, [])
    assert list(step1.num_scheduled_tokens) == [1 + k] and cached.num_computed_tokens == 5
    assert request.num_output_placeholders == 1 + (1 + k)
    # The prefill's output: one token and its drafts, which the worker keeps (a step is in flight).
    sched.update_from_output(prefill, pb.ModelRunnerOutput(request_ids=["r"], sampled_token_ids=[10],
                                                           spec_token_ids=[pb.TokenIds(ids=[11, 12, 13])]))
    assert request.spec_token_ids == [] and request.num_output_placeholders == 1 + k
    # Step 2 is scheduled while step 1 (with k drafts) is in flight: its start assumes all accepted.
    step2 = sched.schedule()
    (cached,) = step2.cached_requests
    assert (cached.num_worker_drafts, cached.drafts_in_flight) == (k, True)
    assert cached.num_computed_tokens == 5 + 1 + k
    # Step 1 accepted one draft of the two the worker had: two tokens; the rest counts as rejected.
    sched.update_from_output(step1, pb.ModelRunnerOutput(request_ids=["r"], sampled_token_ids=[11, 30],
                                                         num_sampled_tokens=[2], num_draft_tokens=[2]))
    assert request.output_token_ids == [10, 11, 30]
    assert request.num_computed_tokens == 5 + 2 + (1 + k)  # the truth so far + step 2 in flight
    assert request.num_output_placeholders == 1 + k and request.num_drafts_in_flight == k
    assert sched.spec.stats.num_draft_tokens == 2 and sched.spec.stats.num_accepted_tokens == 1
    # Step 2's worker had no drafts at all: one token, and the scheduler is exact again.
    sched.update_from_output(step2, pb.ModelRunnerOutput(request_ids=["r"], sampled_token_ids=[31]))
    assert request.num_computed_tokens == request.num_tokens - 1
    assert request.num_output_placeholders == 0 and request.num_drafts_in_flight == 0
    assert sched.spec.stats.num_draft_tokens == 2  # (no drafts verified: no round counted)
