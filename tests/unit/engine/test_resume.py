"""The scheduler side of request migration: a request re-submitted with the tokens it already
generated (`resumed_output_token_ids`) continues exactly where it stopped (greedy and seeded
alike, penalties and max_tokens counting the resumed tokens) and streams back only new tokens."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from services.common.proto import myvllm_pb2 as pb
from services.common.sampling_params import SamplingParams
from services.engine.step_loop import StepLoop
from services.offline.llm import LLM

PROMPT = "Write a short poem about the sea:"


@pytest.fixture(scope="module")
def llm(smollm2_dir: str) -> Iterator[LLM]:
    with LLM(smollm2_dir, dtype="float32", seed=0, max_num_seqs=8, max_model_len=512) as llm:
        yield llm


def _generate(llm: LLM, request_id: str, params: SamplingParams, resumed: list[int] = ()) -> tuple[list[int], str]:
    """Run one engine request to its end: (the tokens it streamed back, its finish reason)."""
    prompt = llm.tokenizer.encode(PROMPT)
    llm.engine.add_request(pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                              sampling=params.to_proto(), resumed_output_token_ids=list(resumed)))
    tokens: list[int] = []
    reasons: list[str] = []

    def emit(outputs: list[pb.RequestOutput]) -> None:
        for out in outputs:
            assert not out.error, out.error
            tokens.extend(out.new_token_ids)
            if out.finish_reason:
                reasons.append(out.finish_reason)

    # The engine's own step loop, over the LLM's workers, until nothing is left to run.
    llm._run_coroutine(StepLoop(llm.engine, llm._workers, emit).run_while_busy())
    assert len(reasons) == 1, "the request never finished"
    return tokens, reasons[0]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    # top_p alone takes the sampler's data-dependent "prefilter" path; penalties read the outputs.
    SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True, frequency_penalty=0.5),
    SamplingParams(temperature=0.8, top_k=40, seed=3, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
], ids=["greedy", "seeded-top-p-penalty", "seeded-top-k-repetition"])
def test_resumed_request_continues_where_it_stopped(llm: LLM, params: SamplingParams) -> None:
    full, reason = _generate(llm, "whole", params)
    assert (len(full), reason) == (12, "length")
    for cut in (1, 9):
        rest, reason = _generate(llm, f"resumed-{cut}", params, resumed=full[:cut])
        assert rest == full[cut:], f"resumed after {cut} tokens"
        assert reason == "length"  # max_tokens counted the resumed tokens
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_running"] == 0


def test_seeded_choices_differ_but_resume_alike(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    first, _ = _generate(llm, "seed-5", params)
    again, _ = _generate(llm, "seed-5-again", params)
    other, _ = _generate(llm, "seed-6", SamplingParams(temperature=1.0, seed=6, max_tokens=8, ignore_eos=True))
    assert first == again and first != other


def test_nothing_left_to_generate_is_refused(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match="already has 4 output tokens; max_tokens is 4"):
        llm.engine.add_request(pb.GenerateRequest(request_id="done", prompt_token_ids=[1, 2, 3],
                                                  sampling=params.to_proto(), resumed_output_token_ids=[5] * 4))
    with pytest.raises(ValueError, match="resumed output token id"):
        llm.engine.add_request(pb.GenerateRequest(request_id="bad", prompt_token_ids=[1, 2, 3],
                                                  sampling=params.to_proto(), resumed_output_token_ids=[-1]))


def test_preempted_seeded_requests_continue_their_random_streams(llm: LLM, smollm2_dir: str) -> None:
    """Preemption recomputes a request exactly as migration does: its seeded stream must go on
    (the generator is keyed by output position, not restarted from the seed)."""
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(n)]} for n in (20, 40, 60, 30)]
    params = [SamplingParams(temperature=1.0, top_k=50, seed=100 + i, max_tokens=16, ignore_eos=True)
              for i in range(len(prompts))]
    roomy = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]  # no preemption
    small = LLM(smollm2_dir, dtype="float32", seed=0, max_num_seqs=8, max_model_len=512,
                num_gpu_blocks_override=12)  # 15 blocks wanted
    together = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
    assert small.stats()["num_preemptions"] > 0
    small.close()
    assert together == roomy
