"""gRPC message size limits: each receiver reads the largest legal message and refuses bigger
ones before parsing them; the scheduler builds every step within what its worker reads."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from support.processes import free_port
from support.schedulers import scheduler_for
from test_config_agreement import scheduler_config, with_worker, worker_config

from services.common.config import MAX_NUM_BATCHED_TOKENS_LIMIT, LoRAConfig
from services.common.message_limits import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_CACHE_SALT_CHARS,
    MAX_ERROR_CHARS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LORA_NAME_CHARS,
    MAX_LORA_PATH_CHARS,
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_TOKEN_IDS,
    STEP_BUDGET_BYTES,
    WORKER_RECEIVE_BYTES,
    generate_request_bytes,
    receive_limit,
    runner_output_bytes,
)
from services.common.proto import myvllm_pb2 as pb
from services.common.proto import myvllm_pb2_grpc as pb_grpc
from services.common.sampling_params import MAX_LOGPROBS
from services.common.structured_outputs import MAX_CHOICES, MAX_SPEC_CHARS
from services.engine.request import Request
from services.engine.request_limits import validate_generate_request
from services.engine.scheduler import Scheduler
from services.scheduler.server import serve_scheduler

WIDE = "\U0001f600"  # four bytes in UTF-8: the widest character


def largest_sampling(vocab_size: int, structured: pb.StructuredOutputs | None = None) -> pb.SamplingParams:
    """Every bounded field of SamplingParams at its limit, with the widest legal values."""
    top = vocab_size - 1
    sp = pb.SamplingParams(
        temperature=1.0, top_p=1.0, top_k=-1, min_p=1.0, repetition_penalty=2.0, frequency_penalty=-2.0,
        presence_penalty=-2.0, seed=-(2**63), max_tokens=1, min_tokens=1, ignore_eos=True,
        stop_token_ids=[top] * MAX_STOP_TOKEN_IDS, logprobs=MAX_LOGPROBS, prompt_logprobs=MAX_LOGPROBS,
        bad_words=[pb.TokenIds(ids=[top] * MAX_BAD_WORD_TOKENS)] * MAX_BAD_WORDS)
    for i in range(MAX_LOGIT_BIAS_ENTRIES):
        sp.logit_bias[top - i] = -100.0
    if structured is not None:
        sp.structured_outputs.CopyFrom(structured)
    return sp


def _largest_choices() -> pb.StructuredOutputs:
    """MAX_CHOICES choices whose JSON list is as long as allowed (each choice's text counts)."""
    overhead = len(json.dumps([""] * MAX_CHOICES))
    each = (MAX_SPEC_CHARS - overhead) // MAX_CHOICES
    choices = ["x" * each] * MAX_CHOICES
    assert len(json.dumps(choices)) <= MAX_SPEC_CHARS
    return pb.StructuredOutputs(choice=pb.StringList(values=choices))


@pytest.mark.parametrize(("structured", "largest_kind"), [
    (None, False),
    (pb.StructuredOutputs(json=WIDE * MAX_SPEC_CHARS), True),
    (pb.StructuredOutputs(grammar=WIDE * MAX_SPEC_CHARS), True),
    (_largest_choices(), False),
], ids=["free", "schema", "grammar", "choices"])
def test_the_largest_legal_request_fits_what_a_scheduler_reads(structured: pb.StructuredOutputs | None,
                                                               largest_kind: bool) -> None:
    vocab_size, max_model_len = 2**31 - 1, 4096
    req = pb.GenerateRequest(request_id=WIDE * MAX_REQUEST_ID_CHARS, prompt_token_ids=[vocab_size - 1] * 4000,
                             resumed_output_token_ids=[vocab_size - 1] * (max_model_len - 4001),
                             sampling=largest_sampling(vocab_size, structured), priority=-1,
                             cache_salt=WIDE * MAX_CACHE_SALT_CHARS,
                             lora_request=pb.LoRARequest(lora_name=WIDE * MAX_LORA_NAME_CHARS, lora_int_id=2**31 - 1,
                                                         lora_path=WIDE * MAX_LORA_PATH_CHARS))
    validate_generate_request(req, vocab_size, max_model_len)  # legal
    size = pb.ClientMessage(generate=req).ByteSize()
    assert size <= generate_request_bytes(max_model_len)
    if largest_kind:  # the bound is close (a loose one would let a client make the scheduler parse more)
        assert generate_request_bytes(max_model_len) < 1.05 * size


def test_the_largest_step_answer_fits_what_a_scheduler_reads_from_its_worker() -> None:
    max_num_seqs, max_num_batched_tokens, k = 3, 10, 2
    top = pb.TokenLogprobs(logprob=-1e30, rank=2**31 - 1, top_ids=[2**31 - 1] * MAX_LOGPROBS,
                           top_logprobs=[-1e30] * MAX_LOGPROBS)
    ids = [f"{i}" + WIDE * (MAX_REQUEST_ID_CHARS - 1) for i in range(max_num_seqs)]
    out = pb.ModelRunnerOutput(
        step_id=2**62, request_ids=ids, sampled_token_ids=[2**31 - 1] * (max_num_seqs * (k + 1)),
        logprobs=[top] * (max_num_seqs * (k + 1)), num_sampled_tokens=[k + 1] * max_num_seqs,
        spec_token_ids=[pb.TokenIds(ids=[2**31 - 1] * k)] * max_num_seqs, error=WIDE * MAX_ERROR_CHARS,
        prompt_logprobs=[pb.PromptLogprobs(request_id=ids[0], first_position=2**31 - 1, logprobs=[top] * 4),
                         pb.PromptLogprobs(request_id=ids[1], first_position=2**31 - 1, logprobs=[top] * 3),
                         pb.PromptLogprobs(request_id=ids[2], first_position=2**31 - 1, logprobs=[top] * 3)],
        lora_load_failures=[pb.LoRALoadFailure(request_id=i, error=WIDE * MAX_ERROR_CHARS) for i in ids])
    assert out.ByteSize() <= runner_output_bytes(max_num_seqs, max_num_batched_tokens, k)


def _scheduler(max_model_len: int = 64, max_num_seqs: int = 64) -> Scheduler:
    # (The step budget a test fills is in bytes; the token budget stays within what a config allows.)
    return scheduler_for(num_blocks=max_num_seqs * 8, block_size=16, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=min(max_num_seqs * max_model_len, MAX_NUM_BATCHED_TOKENS_LIMIT),
                         max_model_len=max_model_len)


def test_the_scheduler_spreads_new_requests_too_big_for_one_step_over_several() -> None:
    """128 requests with the largest sampling parameters (~0.4 MB each with this vocabulary: more
    than the step budget together, as after a migration of a whole replica's requests) go in
    several steps, each within what the worker reads, in arrival order, none left behind."""
    sched = _scheduler(max_num_seqs=128)
    vocab_size = 49152
    for i in range(128):
        sched.add_request(Request(f"r{i}", [7] * 40, largest_sampling(vocab_size), frozenset(), max_tokens=1))
    assert sum(r.sampling_bytes for r in sched.waiting) > STEP_BUDGET_BYTES
    sent: list[str] = []
    steps = 0
    while len(sent) < 128:
        so = sched.schedule()
        steps += 1
        assert so.ByteSize() <= STEP_BUDGET_BYTES
        assert so.new_requests, "a step with room left took nothing"
        sent += [r.request_id for r in so.new_requests]
    assert sent == [f"r{i}" for i in range(128)]
    assert steps >= 2
    assert STEP_BUDGET_BYTES <= WORKER_RECEIVE_BYTES


def test_a_new_request_with_the_largest_adapter_takes_no_more_of_a_step_than_its_estimate() -> None:
    sched = scheduler_for(num_blocks=64, block_size=16, max_model_len=64,
                          lora_config=LoRAConfig(enable_lora=True, max_loras=1))
    lora = pb.LoRARequest(lora_name=WIDE * MAX_LORA_NAME_CHARS, lora_int_id=2**31 - 1,
                          lora_path=WIDE * MAX_LORA_PATH_CHARS)
    sched.add_request(Request(WIDE * MAX_REQUEST_ID_CHARS, [2**31 - 1] * 40, pb.SamplingParams(), frozenset(),
                              max_tokens=1, lora_request=lora))
    estimate = sched.sizer.request_bytes(sched.waiting[0], 40, known=False)
    so = sched.schedule()
    assert so.new_requests[0].lora_request == lora
    bare = pb.SchedulerOutput()
    bare.CopyFrom(so)
    bare.ClearField("new_requests")
    bare.ClearField("num_scheduled_tokens")
    assert so.ByteSize() - bare.ByteSize() <= estimate


def test_a_context_length_whose_one_request_could_overflow_a_step_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match=r"max_model_len 10000000: one request's data in a step could take \d+ "
                                         r"bytes, above the \d+ a step may carry"):
        _scheduler(max_model_len=10_000_000, max_num_seqs=1)
    _scheduler(max_model_len=1_000_000, max_num_seqs=1)  # a million tokens still fit


def test_a_real_scheduler_serves_the_largest_legal_request_and_refuses_a_bigger_message(tiny_llama_dir: str) -> None:
    """Over real gRPC: a request at every limit (prompt of max_model_len - 1 tokens, the largest
    sampling parameters) goes through scheduler and worker; a message above the scheduler's limit
    ends that client's stream with RESOURCE_EXHAUSTED, and the scheduler serves on. The worker
    refuses a message above its own limit the same way."""
    max_model_len, vocab_size = 128, 49152

    async def generate(stub: pb_grpc.SchedulerStub, message: pb.ClientMessage) -> list[int]:
        call = stub.Generate()
        await call.write(message)
        tokens: list[int] = []
        async for step in call:
            for out in step.outputs:
                assert not out.error, out.error
                tokens += out.new_token_ids
                if out.finish_reason:
                    call.cancel()
                    return tokens
        raise AssertionError("the stream ended before the request did")

    async def body(address: str) -> None:
        async with grpc.aio.insecure_channel(address) as channel:  # the worker reads no message above its limit
            too_big = pb.LoadModelRequest(distributed_init_method="x" * WORKER_RECEIVE_BYTES)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pb_grpc.WorkerStub(channel).LoadModel(too_big, timeout=60)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        port = free_port()
        scheduler = asyncio.create_task(serve_scheduler("127.0.0.1", port, scheduler_config(), [address],
                                                        connect_timeout=30))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                                 options=[("grpc.max_receive_message_length", -1)]) as channel:
                await asyncio.wait_for(channel.channel_ready(), 120)
                stub = pb_grpc.SchedulerStub(channel)
                largest = pb.GenerateRequest(request_id="largest", prompt_token_ids=[5] * (max_model_len - 1),
                                             sampling=largest_sampling(vocab_size))
                assert len(await generate(stub, pb.ClientMessage(generate=largest))) == 1

                limit = receive_limit(generate_request_bytes(max_model_len))
                too_big = pb.ClientMessage(generate=pb.GenerateRequest(
                    request_id="too-big", prompt_token_ids=[5], sampling=pb.SamplingParams(max_tokens=1),
                    cache_salt="x" * limit))
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await generate(stub, too_big)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

                small = pb.GenerateRequest(request_id="after", prompt_token_ids=[5, 6, 7],
                                           sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True))
                assert len(await generate(stub, pb.ClientMessage(generate=small))) == 2
        finally:
            scheduler.cancel()
            await asyncio.gather(scheduler, return_exceptions=True)

    asyncio.run(with_worker(worker_config(tiny_llama_dir), body))
