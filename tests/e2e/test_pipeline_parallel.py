"""Pipeline parallelism: how layers split into stages, the scheduler's side (sampled tokens
handed back to the first stage, P steps in flight), and greedy output equal to HF transformers
with the stages running as real processes over gloo, alone and combined with tensor parallelism.

fp32, the tensor-parallel test's prompts (random ids, one long enough for several blocks, a
chunked-prefill budget that mixes prefill chunks with decodes). A stage boundary changes no
arithmetic (the hidden states cross it bit for bit), so PP alone must match exactly; with TP
the all-reduce's order is the tensor-parallel test's, where no difference showed either.
"""

from __future__ import annotations

import time

import pytest
from support.hf_reference import hf_greedy
from support.schedulers import scheduler_for
from test_tensor_parallel import MAX_NEW_TOKENS, _prompts

from services.common.config import VllmConfig
from services.common.proto import myvllm_pb2 as pb
from services.common.sampling_params import SamplingParams
from services.engine.request import Request
from services.offline.llm import LLM
from services.worker.parallel import PipelineParallel, stage_layers


def test_layers_split_into_contiguous_stages_the_extra_ones_before_the_last() -> None:
    assert [stage_layers(30, PipelineParallel(r, 2)) for r in range(2)] == [range(0, 15), range(15, 30)]
    # 5 layers over 3 stages: the two left over go to the stages before the last
    assert [stage_layers(5, PipelineParallel(r, 3)) for r in range(3)] == [range(0, 2), range(2, 4), range(4, 5)]
    # vLLM's order: counting back from the stage before the last
    assert [len(stage_layers(30, PipelineParallel(r, 4))) for r in range(4)] == [7, 8, 8, 7]
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 is more than the model's 2 layers"):
        stage_layers(2, PipelineParallel(0, 3))


def test_pipeline_parallelism_refuses_what_it_cannot_combine_with() -> None:
    with pytest.raises(ValueError, match="async scheduling does not combine with pipeline parallelism"):
        VllmConfig.from_engine_args(model="/m", pipeline_parallel_size=2, async_scheduling=True)
    config = VllmConfig.from_engine_args(model="/m", pipeline_parallel_size=3)
    assert not config.resolve_async_scheduling("cuda")  # the automatic choice stays off
    assert config.steps_in_flight == 3


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, pb.SamplingParams(max_tokens=4, ignore_eos=True), frozenset(), max_tokens=4)


def test_the_scheduler_hands_sampled_tokens_back_and_keeps_in_flight_decodes_out() -> None:
    """With pipeline parallelism the first stage never sees what the last one sampled: a cached
    request carries the tokens its step computes. A request whose decode is still in flight is
    not scheduled again, so the next step in flight holds other requests."""
    s = scheduler_for(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                  pipeline_parallel=True)
    s.add_request(_request("a", [1, 2, 3]))
    first = s.schedule()
    assert [r.request_id for r in first.new_requests] == ["a"]
    s.add_request(_request("b", [4, 5]))
    second = s.schedule()  # "a" is in flight: only "b"
    assert [r.request_id for r in second.new_requests] == ["b"] and not second.cached_requests
    assert not s.schedule().num_scheduled_tokens  # both in flight: nothing to add
    s.update_from_output(first, pb.ModelRunnerOutput(request_ids=["a"], sampled_token_ids=[77]))
    third = s.schedule()
    assert [(c.request_id, list(c.new_token_ids), c.num_computed_tokens) for c in third.cached_requests] == \
        [("a", [77], 3)]
    plain = scheduler_for(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    plain.add_request(_request("a", [1, 2, 3]))
    so = plain.schedule()
    plain.update_from_output(so, pb.ModelRunnerOutput(request_ids=["a"], sampled_token_ids=[77]))
    assert not plain.schedule().cached_requests[0].new_token_ids  # nothing extra without a pipeline


def _greedy(model_dir: str, prompts: list[list[int]], **engine_args) -> tuple[list[list[int]], int]:
    """Greedy ids through an LLM, and the most steps that were on the ranks at once."""
    llm = LLM(model_dir, dtype="float32", seed=0, **engine_args)
    most_in_flight = 0
    collect = llm.worker.collect

    def counting_collect():
        nonlocal most_in_flight
        most_in_flight = max(most_in_flight, len(llm.worker._submitted))
        return collect()

    llm.worker.collect = counting_collect
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]  # every block back
        return [list(o.outputs[0].token_ids) for o in outs], most_in_flight
    finally:
        llm.close()


@pytest.mark.parametrize(("arch", "tp", "pp"), [("qwen2", 1, 2), ("qwen3", 1, 2), ("qwen2", 2, 2), ("qwen3", 2, 2)])
def test_pipeline_parallel_greedy_equals_hf(tiny_model_dir, arch: str, tp: int, pp: int) -> None:
    """qwen2: untied LM head on the last stage, sharded checkpoint; qwen3: tied embeddings, so
    the last stage holds the embedding table as its LM head. TP=2 x PP=2 is four processes, two
    TP groups that all-reduce while hidden states pass between them."""
    model_dir = tiny_model_dir(arch)
    prompts = _prompts()
    want = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    got, most_in_flight = _greedy(model_dir, prompts, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                  max_num_batched_tokens=32)
    assert got == want
    assert most_in_flight == pp  # the pipeline was full: one step per stage


def test_pipeline_parallel_2_on_smollm2_equals_hf(smollm2_dir: str) -> None:
    """The default model's 30 layers as two stages of 15."""
    prompts = _prompts()[:3]
    want = hf_greedy(smollm2_dir, prompts, MAX_NEW_TOKENS)
    assert _greedy(smollm2_dir, prompts, pipeline_parallel_size=2)[0] == want


def test_a_dead_stage_is_a_clear_error_and_the_next_call_works(tiny_qwen2_dir: str) -> None:
    """kill -9 of the last stage: the call fails with an error naming the rank (or gloo's closed
    connection, when the first stage's send notices first) instead of waiting for an answer that
    never comes; the LLM starts fresh ranks and the next call is right."""
    llm = LLM(tiny_qwen2_dir, dtype="float32", pipeline_parallel_size=2)
    try:
        prompt = [{"prompt_token_ids": [5, 6, 7]}]
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        want = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        llm.worker.procs[0].kill()
        llm.worker.procs[0].join(timeout=10)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1: process exited|Connection closed by peer"):
            llm.generate(prompt, params, use_tqdm=False)
        assert time.monotonic() - started < 60
        assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
    finally:
        llm.close()
