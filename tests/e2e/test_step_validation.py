"""The worker refuses a step whose indices do not fit what it holds, before any kernel runs
(services/worker/step_validation.py): unit checks on an InputBatch, then hypothesis throwing
mutated SchedulerOutputs at a real worker process over gRPC: INVALID_ARGUMENT naming the field
each time, and the worker still serves a valid step afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.processes import free_port

from services.common.config import VllmConfig
from services.common.proto import myvllm_pb2 as pb
from services.common.proto import myvllm_pb2_grpc as pb_grpc
from services.worker.input_batch import InputBatch
from services.worker.step_validation import InvalidStep, validate_step

REPO = Path(__file__).resolve().parents[2]
VOCAB = 49152
BLOCK_SIZE = 16
NUM_BLOCKS = 8
MAX_MODEL_LEN = 64
MAX_NUM_SEQS = 4


def _new(rid: str = "a", prompt: list[int] | None = None, blocks: list[int] | None = None,
         computed: int = 0) -> pb.NewRequestData:
    return pb.NewRequestData(request_id=rid, prompt_token_ids=prompt or [1, 2, 3, 4, 5],
                             block_ids=[1] if blocks is None else blocks, num_computed_tokens=computed,
                             sampling=pb.SamplingParams(temperature=0.0, max_tokens=4, logprobs=-1))


def _step(*new: pb.NewRequestData, scheduled: list[int] | None = None) -> pb.SchedulerOutput:
    return pb.SchedulerOutput(step_id=1, new_requests=new,
                              num_scheduled_tokens=scheduled or [len(r.prompt_token_ids) for r in new])


def _batch() -> InputBatch:
    return InputBatch(MAX_NUM_SEQS, MAX_MODEL_LEN, BLOCK_SIZE, seed=0)


def _refused(so: pb.SchedulerOutput, batch: InputBatch | None = None) -> str:
    with pytest.raises(InvalidStep) as info:
        validate_step(so, batch or _batch(), NUM_BLOCKS, VOCAB)
    return info.value.field


def test_a_valid_step_passes_and_each_bad_index_names_its_field() -> None:
    validate_step(_step(_new()), _batch(), NUM_BLOCKS, VOCAB)
    assert _refused(_step(_new(blocks=[NUM_BLOCKS]))) == "new_requests[0].block_ids"
    assert _refused(_step(_new(blocks=[-1]))) == "new_requests[0].block_ids"
    assert _refused(_step(_new(prompt=[1, VOCAB]))) == "new_requests[0].prompt_token_ids"
    assert _refused(_step(_new(prompt=list(range(MAX_MODEL_LEN + 1))))) == "new_requests[0].prompt_token_ids"
    assert _refused(_step(_new(), scheduled=[6])) == "new_requests[0].num_computed_tokens"
    assert _refused(_step(_new(), scheduled=[0])) == "num_scheduled_tokens"
    assert _refused(_step(_new(), scheduled=[5, 1])) == "num_scheduled_tokens"
    assert _refused(_step(_new(prompt=list(range(20)), blocks=[1]))) == "new_requests[0].num_computed_tokens"
    assert _refused(_step(*[_new(str(i)) for i in range(MAX_NUM_SEQS + 1)])) == "new_requests"
    assert _refused(_step(_new("a"), _new("a"))) == "new_requests.request_id"
    bias = _new()
    bias.sampling.logit_bias[VOCAB] = 1.0
    assert _refused(_step(bias)) == "new_requests[0].sampling.logit_bias"
    unknown = pb.SchedulerOutput(cached_requests=[pb.CachedRequestData(request_id="nope", num_computed_tokens=0)],
                                 num_scheduled_tokens=[1])
    assert _refused(unknown) == "cached_requests[0].request_id"
    masked = _step(_new())
    masked.structured_output_request_ids.append("a")
    masked.grammar_bitmask = b"\0" * 8
    assert _refused(masked) == "grammar_bitmask"


def test_cached_requests_are_checked_against_what_the_batch_holds() -> None:
    batch = _batch()
    batch.add(_new(prompt=list(range(1, 17)), blocks=[1]))  # 16 tokens, one full block
    ok = pb.SchedulerOutput(cached_requests=[pb.CachedRequestData(request_id="a", num_computed_tokens=15)],
                            num_scheduled_tokens=[1])
    validate_step(ok, batch, NUM_BLOCKS, VOCAB)
    beyond_blocks = pb.SchedulerOutput(cached_requests=[pb.CachedRequestData(request_id="a", num_computed_tokens=16,
                                                                             spec_token_ids=[5])],
                                       num_scheduled_tokens=[1])
    assert _refused(beyond_blocks, batch) == "cached_requests[0].num_computed_tokens"  # slot 16 has no block
    new_block = pb.SchedulerOutput(cached_requests=[pb.CachedRequestData(request_id="a", num_computed_tokens=16,
                                                                         new_block_ids=[NUM_BLOCKS + 5])],
                                   num_scheduled_tokens=[1])
    assert _refused(new_block, batch) == "cached_requests[0].new_block_ids"
    finished = pb.SchedulerOutput(finished_request_ids=["a"], num_scheduled_tokens=[1],
                                  cached_requests=[pb.CachedRequestData(request_id="a", num_computed_tokens=15)])
    assert _refused(finished, batch) == "cached_requests[0].request_id"  # finished in this very step


def test_a_row_verifying_the_workers_own_drafts_is_bounded_by_what_the_worker_holds() -> None:
    """Async scheduling with drafts: the scheduler's counts are upper bounds; the worker runs the
    row from its own (last token + its drafts) and refuses what cannot bound or hold that."""
    batch = _batch()
    batch.add(_new(prompt=list(range(1, 15)), blocks=[1]))  # 14 tokens in one block of 16
    batch.set_own_drafts(0, [7, 8, 9])

    def blind(scheduled: int, n: int = 2, computed: int = 16, **extra) -> pb.SchedulerOutput:
        return pb.SchedulerOutput(cached_requests=[pb.CachedRequestData(
            request_id="a", num_computed_tokens=computed, num_worker_drafts=n, drafts_in_flight=True, **extra)],
            num_scheduled_tokens=[scheduled])

    validate_step(blind(3), batch, NUM_BLOCKS, VOCAB)  # runs [13, 16): the last token + 2 drafts
    assert _refused(blind(4), batch) == "cached_requests[0].num_worker_drafts"  # not 1 + n
    assert _refused(blind(3, computed=12), batch) == "cached_requests[0].num_computed_tokens"  # below the truth
    assert _refused(blind(4, n=3), batch) == "cached_requests[0].num_computed_tokens"  # [13, 17): no block
    assert _refused(blind(3, spec_token_ids=[5, 6]), batch) == "cached_requests[0].spec_token_ids"
    assert batch.update(blind(3).cached_requests[0]) == 0
    assert (batch.num_computed_tokens[0], batch.num_spec[0]) == (13, 2)
    assert list(batch.token_ids[0, 14:16]) == [7, 8]


# --------------------------------------------------------------------- a real worker


@pytest.fixture(scope="module")
def worker(tiny_llama_dir: str) -> Iterator[pb_grpc.WorkerStub]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "services.entrypoints.cli", "worker", "--port", str(port), "--model",
                             tiny_llama_dir, "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32"],
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), MYVLLM_NUM_THREADS="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.WorkerStub(channel)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                stub.Health(pb.Empty(), timeout=1)
                break
            except grpc.RpcError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
                time.sleep(0.2)
        config = VllmConfig.from_engine_args(model="", max_num_seqs=MAX_NUM_SEQS).to_proto(with_model_config=False)
        stub.LoadModel(pb.LoadModelRequest(config=config), timeout=60)
        stub.InitKVCache(pb.InitKVCacheRequest(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE), timeout=60)
        yield stub
    finally:
        channel.close()
        proc.terminate()
        proc.wait(timeout=30)


def _execute(stub: pb_grpc.WorkerStub, so: pb.SchedulerOutput) -> list[pb.ModelRunnerOutput]:
    return list(stub.Execute(iter([so]), timeout=30))


def _mutations() -> st.SearchStrategy[tuple[str, pb.SchedulerOutput]]:
    """(the field the worker must name, a step with that field out of bounds)."""
    outside = st.one_of(st.integers(-2**31, -1), st.integers(NUM_BLOCKS, 2**31 - 1))
    off_vocab = st.one_of(st.integers(-2**31, -1), st.integers(VOCAB, 2**31 - 1))

    def block(value: int) -> tuple[str, pb.SchedulerOutput]:
        return "new_requests[0].block_ids", _step(_new(blocks=[value]))

    def token(value: int) -> tuple[str, pb.SchedulerOutput]:
        return "new_requests[0].prompt_token_ids", _step(_new(prompt=[1, value, 3]))

    def computed(value: int) -> tuple[str, pb.SchedulerOutput]:
        return "new_requests[0].num_computed_tokens", _step(_new(computed=value), scheduled=[5])

    def scheduled(value: int) -> tuple[str, pb.SchedulerOutput]:
        return ("num_scheduled_tokens" if value < 1 else "new_requests[0].num_computed_tokens",
                _step(_new(), scheduled=[value]))

    def cached(rid: str) -> tuple[str, pb.SchedulerOutput]:
        return "cached_requests[0].request_id", pb.SchedulerOutput(
            cached_requests=[pb.CachedRequestData(request_id=rid, num_computed_tokens=0)], num_scheduled_tokens=[1])

    return st.one_of(outside.map(block), off_vocab.map(token),
                     st.one_of(st.integers(-2**31, -1), st.integers(1, 2**31 - 6)).map(computed),
                     st.one_of(st.integers(-2**31, 0), st.integers(6, 2**31 - 1)).map(scheduled),
                     st.text(min_size=1, max_size=8).map(cached))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_mutations())
def test_mutated_steps_are_refused_by_a_real_worker(worker: pb_grpc.WorkerStub, case) -> None:
    field, so = case
    with pytest.raises(grpc.RpcError) as info:
        _execute(worker, so)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert f"{field}:" in info.value.details()


def test_the_worker_serves_a_valid_step_after_refusals(worker: pb_grpc.WorkerStub) -> None:
    with pytest.raises(grpc.RpcError):
        _execute(worker, _step(_new(blocks=[2**31 - 1])))
    (out,) = _execute(worker, _step(_new()))
    assert not out.error and list(out.request_ids) == ["a"] and 0 <= out.sampled_token_ids[0] < VOCAB


def test_a_refused_step_is_reported_as_a_failure_of_a_live_worker_not_as_a_dead_one() -> None:
    """The scheduler's WorkerFault says what happened: INVALID_ARGUMENT came from a worker that is
    still there ("failed"); UNAVAILABLE means it went away ("is gone")."""
    import asyncio

    from services.scheduler.worker_link import WorkerFault, WorkerLink

    async def fault(code: grpc.StatusCode) -> str:
        link = WorkerLink("127.0.0.1:1", 1 << 20)

        async def rpc() -> None:
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="slot_mapping[3] out of range")

        try:
            await link._within_timeout(rpc(), "answer")
        except WorkerFault as e:
            return str(e)
        finally:
            await link.channel.close()
        raise AssertionError("no WorkerFault")

    refused = asyncio.run(fault(grpc.StatusCode.INVALID_ARGUMENT))
    assert "failed (INVALID_ARGUMENT: slot_mapping[3] out of range)" in refused and "is gone" not in refused
    assert "is gone (UNAVAILABLE" in asyncio.run(fault(grpc.StatusCode.UNAVAILABLE))
