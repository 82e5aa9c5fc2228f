"""P/D disaggregation between two engine replicas as real processes (a worker and a scheduler
each, started with --kv-transfer-config): the producer prefills over gRPC, its final output's
kv_transfer_params go to the consumer, whose worker loads the KV from shared memory
(SharedMemoryConnector) or fetches it from the producer's worker over gRPC (GrpcConnector);
greedy tokens equal the producer's own colocated generation, nothing is left behind, and params
naming a segment that is not there make the consumer prefill itself, with the same tokens.
GrpcConnector's replicas run with Redis and an internal token: the consumer knows the producer's
worker from its signed registry entry alone, and refuses params naming any other address before
anything runs (its worker never dials there, so the token never leaves)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading

import pytest
from support.replica import WORKER_ARGS, Replica

from services.client.grpc_client import AsyncClient, RequestRejected
from services.common.proto import myvllm_pb2 as pb

MAX_TOKENS = 8


def kv_flag(connector: str, role: str, shm_dir: str) -> tuple[str, ...]:
    extra = {"shm_dir": shm_dir} if connector == "SharedMemoryConnector" else {}
    return ("--kv-transfer-config", json.dumps({"kv_connector": connector, "kv_role": role,
                                                "kv_connector_extra_config": extra}))


async def generate(replica: Replica, tokens: list[int], max_tokens: int,
                   params: pb.KVTransferParams | None = None) -> tuple[list[int], pb.RequestOutput]:
    out_tokens, last = [], None
    async with AsyncClient(replica.address, timeout=60, token=replica.token) as client:
        async for out in client.generate(tokens, pb.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                   logprobs=-1),
                                         kv_transfer_params=params):
            out_tokens += out.new_token_ids
            last = out
    return out_tokens, last


class Listener:
    """A loopback port that counts the connections made to it (and what they sent)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.settimeout(2)
            try:
                self.received.append(conn.recv(65536))
            except OSError:
                self.received.append(b"")
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("connector", ["SharedMemoryConnector", "GrpcConnector"])
def test_two_replicas_hand_a_prompt_over(tiny_llama_dir, tmp_path, redis_server, connector: str) -> None:
    shm = str(tmp_path)
    grpc = connector == "GrpcConnector"
    replicas = []
    listener = Listener()
    try:
        for role in ("kv_producer", "kv_consumer"):
            flag = kv_flag(connector, role, shm)
            replicas.append(Replica(tiny_llama_dir, worker_args=(*WORKER_ARGS, *flag),
                                    extra_scheduler_args=("--block-size", "4", *flag),
                                    **({"redis_url": redis_server, "token": "pd-mesh-internal-token"} if grpc else {})))
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
            if grpc:
                # Params naming an address that is no producer of the registry (here: a port we
                # listen on): refused before anything runs, and nobody dials it with the token.
                elsewhere = pb.KVTransferParams()
                elsewhere.CopyFrom(final.kv_transfer_params)
                elsewhere.remote_host, elsewhere.remote_port = "127.0.0.1", listener.port
                with pytest.raises(RequestRejected, match=rf"kv_transfer_params.remote_host.*:{listener.port}'") as e:
                    await generate(consumer, tokens, MAX_TOKENS, elsewhere)
                assert e.value.error_kind == pb.INVALID_REQUEST
                assert consumer.stats().kv_transfer_load_failures == 1  # no load was even tried

        asyncio.run(body())
        for r in replicas:
            stats = r.stats()
            assert stats.num_free_blocks == stats.num_total_blocks and stats.num_waiting == 0
        if not grpc:  # (the unread segment of the last prompt expires; GrpcConnector's with its worker)
            for name in os.listdir(shm):
                os.unlink(os.path.join(shm, name))
        assert listener.received == []  # nothing ever connected
    finally:
        listener.close()
        for r in replicas:
            r.stop()
