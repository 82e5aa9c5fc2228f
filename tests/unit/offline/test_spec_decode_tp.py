"""Speculative decoding with a draft model over two tensor-parallel ranks (the offline `LLM`: rank 0
in this process, rank 1 a child): the draft is sharded like the target, every rank runs the same
draft steps and draws the same random drafts (services/worker/spec_decode/draft_model.py).

Greedy outputs are token-identical to speculation off on one rank; a seeded random-sampling run
(drafts accepted sometimes, refused sometimes) is the same twice; and in both, every rank's answer
to every step (sampled tokens, drafts, logprobs) is rank 0's, and no rank reports having drawn
other drafts than rank 0 before they were broadcast."""

from __future__ import annotations

import gc

import pytest
from test_spec_decode import ALPHABET, DIST_PROMPT

from services.common.sampling_params import SamplingParams
from services.offline.llm import LLM
from services.worker.rank_workers import ParallelWorkers

PROMPTS = [[1000 + 13 * i for i in range(12)], [7, 99, 4242, 31000, 17], list(range(3000, 3040)),
           [48000 - 5 * i for i in range(25)]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)
# Confined to 8 tokens at a high temperature: the random draft's and the target's distributions
# overlap, so drafts are accepted sometimes and refused sometimes.
RANDOM = SamplingParams(temperature=8.0, top_k=8, max_tokens=20, ignore_eos=True,
                        logit_bias={t: 100.0 for t in ALPHABET})
NUM_RANDOM = 12


def _run(model_dir: str, **engine_args) -> tuple[list[list[int]], list[list[int]] | None, dict]:
    """Greedy outputs of PROMPTS, then (with speculation) seeded random ones, and the stats."""
    llm = LLM(model_dir, seed=0, dtype="float32", block_size=16, **engine_args)
    try:
        greedy = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        randoms = None
        if "speculative_config" in engine_args:
            outs = llm.generate([{"prompt_token_ids": DIST_PROMPT}] * NUM_RANDOM, RANDOM, use_tqdm=False)
            randoms = [list(o.outputs[0].token_ids) for o in outs]
        return [list(o.outputs[0].token_ids) for o in greedy], randoms, llm.stats()
    finally:
        llm.close()
        del llm
        gc.collect()


@pytest.fixture
def rank_agreement(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Per executed step: whether every rank answered exactly what rank 0 did."""
    steps: list[bool] = []
    answers = ParallelWorkers._answers

    def checked(self, local, method: str) -> list:
        out = answers(self, local, method)
        if method == "execute" and out[0] is not None:
            steps.append(all(o == out[0] for o in out[1:]))
        return out

    monkeypatch.setattr(ParallelWorkers, "_answers", checked)
    return steps


def test_draft_model_over_two_ranks_is_exact_and_the_ranks_agree(
        tiny_qwen3_dir: str, tiny_llama_dir: str, rank_agreement: list[bool], capfd: pytest.CaptureFixture) -> None:
    baseline, _, _ = _run(tiny_qwen3_dir)
    spec = {"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 3,
            "disable_by_batch_size": 0}
    runs = [_run(tiny_qwen3_dir, tensor_parallel_size=2, speculative_config=spec) for _ in range(2)]
    for greedy, randoms, stats in runs:
        mismatches = [i for i, (g, e) in enumerate(zip(greedy, baseline, strict=True)) if g != e]
        assert not mismatches, f"prompts {mismatches} differ with a draft model over two ranks"
        assert all(len(r) == RANDOM.max_tokens and set(r) <= set(ALPHABET) for r in randoms), randoms
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats
        assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert runs[0][1] == runs[1][1], "the same seeded random run gave other outputs"
    assert len(set(map(tuple, runs[0][1]))) > 1  # random sampling, not one sequence
    assert rank_agreement and all(rank_agreement), f"{rank_agreement.count(False)} steps where the ranks differed"
    captured = capfd.readouterr()
    assert "drew other drafts than rank 0" not in captured.out + captured.err
