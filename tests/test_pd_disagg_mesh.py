"""P/D disaggregation between two engine replicas as real processes (a worker and a scheduler
each, started with --kv-transfer-config): the producer prefills over gRPC, its final output's
kv_transfer_params go to the consumer, whose worker loads the KV from shared memory
(SharedMemoryConnector) or fetches it from the producer's worker over gRPC (GrpcConnector);
greedy tokens equal the producer's own colocated generation, nothing is left behind, and params
naming a segment that is not there make the consumer prefill itself, with the same tokens."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from replica import WORKER_ARGS, Replica

from services.common.proto import myvllm_pb2 as pb
from services.sdk.client import AsyncClient

MAX_TOKENS = 8


def kv_flag(connector: str, role: str, shm_dir: str) -> tuple[str, ...]:
    extra = {"shm_dir": shm_dir} if connector == "SharedMemoryConnector" else {}
    return ("--kv-transfer-config", json.dumps({"kv_connector": connector, "kv_role": role,
                                                "kv_connector_extra_config": extra}))


async def generate(replica: Replica, tokens: list[int], max_tokens: int,
                   params: pb.KVTransferParams | None = None) -> tuple[list[int], pb.RequestOutput]:
    out_tokens, last = [], None
    async with AsyncClient(replica.address, timeout=60) as client:
        async for out in client.generate(tokens, pb.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                   logprobs=-1),
                                         kv_transfer_params=params):
            out_tokens += out.new_token_ids
            last = out
    return out_tokens, last


@pytest.mark.parametrize("connector", ["SharedMemoryConnector", "GrpcConnector"])
def test_two_replicas_hand_a_prompt_over(tiny_llama_dir, tmp_path, connector: str) -> None:
    shm = str(tmp_path)
    grpc = connector == "GrpcConnector"
    replicas = []
    try:
        for role in ("kv_producer", "kv_consumer"):
            flag = kv_flag(connector, role, shm)
            replicas.append(Replica(tiny_llama_dir, worker_args=(*WORKER_ARGS, *flag),
                                    extra_scheduler_args=("--block-size", "4", *flag)))
        producer, consumer = replicas
        for r in replicas:
            r.wait_ready()
        prompts = [[100 + 7 * i + j for j in range(10 + 5 * i)] for i in range(3)]

        async def body() -> None:
            for tokens in prompts:
                expected, _ = await generate(producer, tokens, MAX_TOKENS)
                first, final = await generate(producer, tokens, 1, pb.KVTransferParams(do_remote_decode=True))
                params = final.kv_transfer_params
                assert params.do_remote_prefill and params.remote_num_tokens == (len(tokens) - 1) // 4 * 4
                assert os.listdir(shm) == ([] if grpc else [params.remote_handle])
                assert (f"{params.remote_host}:{params.remote_port}" == producer.worker_address) if grpc \
                    else not params.remote_host
                got, _ = await generate(consumer, tokens, MAX_TOKENS, params)
                assert got == expected and first == expected[:1]
                assert os.listdir(shm) == []
            # A segment that is not there (read already, expired, its producer gone): the consumer
            # prefills itself, same tokens.
            tokens = [5 + j for j in range(13)]
            expected, _ = await generate(producer, tokens, MAX_TOKENS)
            _, final = await generate(producer, tokens, 1, pb.KVTransferParams(do_remote_decode=True))
            gone = pb.KVTransferParams()
            gone.CopyFrom(final.kv_transfer_params)
            gone.remote_handle = "mvkv-" + "0" * 32
            got, _ = await generate(consumer, tokens, MAX_TOKENS, gone)
            assert got == expected
            stats = consumer.stats()
            assert (stats.kv_transfer_loads, stats.kv_transfer_load_failures) == (len(prompts), 1)

        asyncio.run(body())
        for r in replicas:
            stats = r.stats()
            assert stats.num_free_blocks == stats.num_total_blocks and stats.num_waiting == 0
        if not grpc:  # (the unread segment of the last prompt expires; GrpcConnector's with its worker)
            for name in os.listdir(shm):
                os.unlink(os.path.join(shm, name))
    finally:
        for r in replicas:
            r.stop()
