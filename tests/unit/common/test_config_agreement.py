"""One configuration (VllmConfig) for scheduler and worker: the scheduler's LoadModel carries its
whole configuration but the model part, the worker answers with the configuration it runs, and
the two refuse to start together when they disagree on what both read (parallel and
speculative settings), naming the field. Real gRPC on loopback, a real worker servicer in this
process loading a tiny checkpoint."""

from __future__ import annotations

import asyncio

import pytest

from services.common import grpc_utils
from services.common.config import SHARED_PARTS, VllmConfig, config_mismatches
from services.common.grpc_utils import StartupError
from services.common.message_limits import WORKER_RECEIVE_BYTES
from services.common.proto import myvllm_pb2 as pb
from services.common.proto import myvllm_pb2_grpc as pb_grpc
from services.engine.worker_setup import set_up_workers
from services.scheduler.server import serve_scheduler
from services.scheduler.worker_group import WorkerGroup
from services.scheduler.worker_link import WorkerLink
from services.worker.server import WorkerServicer

NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


async def with_worker(worker_config: VllmConfig, body) -> None:
    """Run `body(address)` beside a worker servicer started with `worker_config` (its flags)."""
    servicer = WorkerServicer(pb.LoadModelRequest(config=worker_config.to_proto()))
    await servicer.preload()
    server = grpc_utils.server(WORKER_RECEIVE_BYTES)
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await body(f"127.0.0.1:{port}")
    finally:
        await server.stop(None)
        servicer.compute.shutdown(wait=True)


def worker_config(model_dir: str, **overrides) -> VllmConfig:
    return VllmConfig.from_engine_args(model=model_dir, dtype="float32", max_model_len=128, **overrides)


def scheduler_config(**overrides) -> VllmConfig:
    return VllmConfig.from_engine_args(model="", max_num_seqs=4, kv_cache_memory_bytes=8 << 20, **overrides)


def test_the_scheduler_adopts_the_workers_model_part_and_gets_its_own_parts_back(tiny_llama_dir: str) -> None:
    async def body(address: str) -> None:
        config = scheduler_config(speculative_config=NGRAM)
        group = WorkerGroup([WorkerLink(address, 1 << 20)])
        info, num_blocks = await set_up_workers(group, config, worker_owns_model=True)
        m = config.model_config
        assert (m.model, m.dtype, m.max_model_len) == (tiny_llama_dir, "float32", 128)
        assert info.config.scheduler_config.max_num_seqs == 4  # the worker took the scheduler's part
        assert info.config.speculative_config.num_speculative_tokens == 2
        assert info.config == config.to_proto()  # one configuration, the same on both sides
        assert num_blocks > 1

    asyncio.run(with_worker(worker_config(tiny_llama_dir, speculative_config=NGRAM), body))


@pytest.mark.parametrize(("worker_spec", "scheduler_spec", "named"), [
    (NGRAM, None, "speculative_config: {method='ngram'"),
    (None, NGRAM, "vs {method='ngram'"),
    (NGRAM, {**NGRAM, "num_speculative_tokens": 3}, "speculative_config.num_speculative_tokens: 2 vs 3"),
])
def test_a_speculative_config_mismatch_is_refused_at_start_naming_the_field(
        tiny_llama_dir: str, worker_spec: dict | None, scheduler_spec: dict | None, named: str) -> None:
    async def body(address: str) -> None:
        with pytest.raises(StartupError) as refused:
            await serve_scheduler("127.0.0.1", 0, scheduler_config(speculative_config=scheduler_spec), [address],
                                  connect_timeout=30)
        assert "configuration mismatch between scheduler and worker" in str(refused.value)
        assert "FAILED_PRECONDITION" in str(refused.value) or "refused" in str(refused.value)
        assert named in str(refused.value)

    asyncio.run(with_worker(worker_config(tiny_llama_dir, speculative_config=worker_spec), body))


def test_a_worker_count_that_is_not_tp_times_pp_is_refused_before_any_call() -> None:
    async def body() -> None:
        with pytest.raises(StartupError, match=r"1 worker address\(es\) for tensor_parallel_size=2 x "
                                               r"pipeline_parallel_size=1 ranks"):
            await serve_scheduler("127.0.0.1", 0, scheduler_config(tensor_parallel_size=2), ["127.0.0.1:1"])

    asyncio.run(body())


def test_config_mismatches_names_every_differing_field_of_the_shared_parts() -> None:
    a = VllmConfig.from_engine_args(model="/a", tensor_parallel_size=2).to_proto()
    b_args = {"model": "/b", "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "max_num_seqs": 3}
    b = VllmConfig.from_engine_args(**b_args).to_proto()
    assert config_mismatches(a, b, SHARED_PARTS) == ["parallel_config.pipeline_parallel_size: 1 vs 2"]
    assert config_mismatches(a, a, [f.name for f in pb.VllmConfig.DESCRIPTOR.fields]) == []
    assert VllmConfig.from_proto(b) == VllmConfig.from_engine_args(**b_args)
