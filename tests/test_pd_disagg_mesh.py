"""P/D disaggregation between two engine replicas as real processes (a worker and a scheduler
each, started with --kv-transfer-config): the producer prefills over gRPC, its final output's
kv_transfer_params go to the consumer, whose worker loads the KV from shared memory; greedy tokens
equal the producer's own colocated generation, nothing is left behind."""

from __future__ import annotations

import asyncio
import json
import os

from replica import WORKER_ARGS, Replica

from services.common.proto import myvllm_pb2 as pb
from services.sdk.client import AsyncClient

MAX_TOKENS = 8


def kv_flag(role: str, shm_dir: str) -> tuple[str, ...]:
    return ("--kv-transfer-config", json.dumps({"kv_connector": "SharedMemoryConnector", "kv_role": role,
                                                "kv_connector_extra_config": {"shm_dir": shm_dir}}))


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


def test_two_replicas_hand_a_prompt_over_through_shared_memory(tiny_llama_dir, tmp_path) -> None:
    shm = str(tmp_path)
    replicas = []
    try:
        for role in ("kv_producer", "kv_consumer"):
            flag = kv_flag(role, shm)
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
                assert os.listdir(shm) == [params.remote_handle]
                got, _ = await generate(consumer, tokens, MAX_TOKENS, params)
                assert got == expected and first == expected[:1]
                assert os.listdir(shm) == []

        asyncio.run(body())
        for r in replicas:
            stats = r.stats()
            assert stats.num_free_blocks == stats.num_total_blocks and stats.num_waiting == 0
    finally:
        for r in replicas:
            r.stop()
