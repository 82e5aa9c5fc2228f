"""GrpcConnector's transport, piece by piece: a producer's segments held in memory within
max_buffer_bytes and handed out once, in 1 MiB chunks that decode back to the same blocks; a real
gRPC FetchKV between two connectors (the internal token asked for and presented), a missing
segment, a producer that hangs past fetch_timeout_s, a segment larger than the consumer's cache
could hold; the params and configuration each connector accepts; and the producer workers a
consumer may fetch from (configured, or signed registry entries), nothing else."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import pytest
import torch
from support.processes import free_port

from services.common import grpc_utils
from services.common.auth import server_interceptors
from services.common.block_hash import block_hashes
from services.common.kv_transfer_config import KVTransferConfig
from services.common.kv_transfer_params import check_params, params_from_dict, params_to_dict
from services.common.proto import myvllm_pb2 as pb
from services.common.proto import myvllm_pb2_grpc as pb_grpc
from services.common.redis_registry import KV_ADDRESS_FIELD, BadEntry, kv_producer_addresses, parse_entry, sign_entry
from services.engine.kv_connector import KVConnectorScheduler
from services.scheduler.kv_producers import ProducerRegistry
from services.worker.kv_connector import FETCH_CHUNK_BYTES, GrpcConnector, serve_segment
from services.worker.kv_segment import KVLayout, SegmentError, decode_segment
from services.worker.step_validation import InvalidStep

LAYOUT = KVLayout(model_id="m", dtype=torch.float32, num_layers=2, block_size=4, num_kv_heads=2, head_dim=64)
TOKEN = "secret-token"
HANDLE = "mvkv-" + "ab" * 16


def _caches(num_blocks: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, num_blocks, 4, 2, 64, generator=g) for _ in range(LAYOUT.num_layers)]


def _config(role: str, **extra) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="GrpcConnector", kv_role=role, kv_connector_extra_config=extra)


def test_segments_are_held_within_the_buffer_handed_out_once_in_chunks() -> None:
    caches = _caches(600, 0)
    producer = GrpcConnector(_config("kv_producer", max_buffer_bytes=2 << 20), LAYOUT, caches)
    try:
        blocks = list(range(1, 301))  # 300 blocks x 2 layers x 4 KiB: 2.3 MiB
        hashes = block_hashes(list(range(1200)), 4)
        done = producer._save(HANDLE, blocks, hashes)
        assert not done.ok  # past max_buffer_bytes: refused (its consumer prefills locally)
        done = producer._save(HANDLE, blocks[:200], hashes[:200])
        assert done.ok and done.num_bytes > 1 << 20
        chunks = list(serve_segment(producer, HANDLE))
        assert len(chunks) == 2 and all(len(c.data) == FETCH_CHUNK_BYTES for c in chunks[:-1])
        with pytest.raises(KeyError):  # read once
            list(serve_segment(producer, HANDLE))
        data = b"".join(c.data for c in chunks)
        layers = decode_segment(data, LAYOUT, 10, hashes[10:200], max_blocks=600)
        index = torch.tensor(blocks[10:200])
        for got, cache in zip(layers, caches, strict=True):
            assert torch.equal(got, cache.index_select(1, index))
        assert producer._buffer_bytes == 0
    finally:
        producer.close()


def _serve(connector: GrpcConnector, token: str | None, stall: threading.Event | None = None):
    """A real gRPC server answering FetchKV from `connector` (the worker's handler's logic)."""

    class Servicer(pb_grpc.WorkerServicer):
        async def FetchKV(self, request, context):
            if stall is not None:
                await asyncio.sleep(30)
            try:
                chunks = list(serve_segment(connector, request.handle))
            except KeyError:
                await context.abort(grpc.StatusCode.NOT_FOUND, "no such segment")
            for chunk in chunks:
                yield chunk

    port = free_port()
    ready, stop = threading.Event(), threading.Event()

    def run() -> None:
        async def main() -> None:
            server = grpc_utils.server(1 << 20, server_interceptors(token))
            pb_grpc.add_WorkerServicer_to_server(Servicer(), server)
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            await server.stop(0)

        asyncio.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10)
    return port, stop, thread


def _load(handle: str, port: int, hashes: list[bytes], block_ids: list[int]) -> pb.KVLoad:
    return pb.KVLoad(request_id="r", handle=handle, first_block=0, block_ids=block_ids, block_hashes=hashes,
                     remote_host="127.0.0.1", remote_port=port)


def test_a_consumer_fetches_over_grpc_with_the_token_and_fails_cleanly_otherwise() -> None:
    producer = GrpcConnector(_config("kv_producer"), LAYOUT, _caches(64, 1))
    consumer = GrpcConnector(_config("kv_consumer", fetch_timeout_s=2), LAYOUT, _caches(64, 2), token=TOKEN)
    stranger = GrpcConnector(_config("kv_consumer"), LAYOUT, _caches(64, 3), token="wrong")
    port, stop, thread = _serve(producer, TOKEN)
    try:
        hashes = block_hashes(list(range(40)), 4)
        assert producer._save(HANDLE, list(range(1, 11)), hashes).ok
        with pytest.raises(SegmentError, match="UNAUTHENTICATED"):
            stranger._fetch(_load(HANDLE, port, hashes, list(range(20, 30))))
        done = consumer._load(_load(HANDLE, port, hashes, list(range(20, 30))))
        assert done.ok and done.num_bytes == 10 * 2 * LAYOUT.block_bytes_per_layer
        for src, dst in zip(producer.kv_caches, consumer.kv_caches, strict=True):
            assert torch.equal(src[:, 1:11], dst[:, 20:30])
        with pytest.raises(SegmentError, match="NOT_FOUND"):  # read once
            consumer._fetch(_load(HANDLE, port, hashes, list(range(20, 30))))
        assert not consumer._load(_load(HANDLE, port, hashes, list(range(20, 30)))).ok
        # A segment that is not the prompt's: refused before a byte reaches the cache.
        assert producer._save(HANDLE, list(range(1, 11)), hashes).ok
        with pytest.raises(SegmentError, match="hash differs"):
            consumer._fetch(_load(HANDLE, port, block_hashes(list(range(1, 41)), 4), list(range(20, 30))))
        # A segment bigger than the consumer's whole cache could be: refused.
        small = GrpcConnector(_config("kv_consumer"), LAYOUT, _caches(4, 4), token=TOKEN)
        assert producer._save(HANDLE, list(range(1, 11)), hashes).ok
        with pytest.raises(SegmentError, match="more than"):
            small._fetch(_load(HANDLE, port, hashes[:2], [1, 2]))
        small.close()
    finally:
        stop.set()
        thread.join(10)
        for c in (producer, consumer, stranger):
            c.close()


def test_a_hanging_producer_costs_fetch_timeout_s_then_a_local_prefill() -> None:
    producer = GrpcConnector(_config("kv_producer"), LAYOUT, _caches(16, 1))
    consumer = GrpcConnector(_config("kv_consumer", fetch_timeout_s=1), LAYOUT, _caches(16, 2))
    port, stop, thread = _serve(producer, None, stall=threading.Event())
    try:
        started = time.monotonic()
        done = consumer._load(_load(HANDLE, port, block_hashes(list(range(8)), 4), [3, 4]))
        assert not done.ok and 0.9 < time.monotonic() - started < 5
        started = time.monotonic()
        dead = consumer._load(_load(HANDLE, free_port(), block_hashes(list(range(8)), 4), [3, 4]))
        assert not dead.ok and time.monotonic() - started < 5  # nobody there
    finally:
        stop.set()
        thread.join(10)
        producer.close()
        consumer.close()


def test_params_and_configuration_of_each_connector() -> None:
    params = {"do_remote_prefill": True, "remote_handle": HANDLE, "remote_num_tokens": 8,
              "remote_block_hash": "00" * 32, "remote_host": "worker-0.pd.svc", "remote_port": 40001}
    assert params_to_dict(params_from_dict(params)) == params
    for bad, message in (({"remote_host": "a b"}, "host"), ({"remote_port": 70000}, "port"),
                         ({"remote_port": None}, "together")):
        with pytest.raises(ValueError, match=message):
            params_from_dict({**params, **bad})
    with pytest.raises(ValueError, match="together"):
        check_params(pb.KVTransferParams(remote_host="h", remote_port=1))  # no handle
    assert _config("kv_both", fetch_timeout_s=3, max_buffer_bytes=1 << 30).crosses_hosts
    with pytest.raises(ValueError, match="shm_dir"):
        _config("kv_producer", shm_dir="/dev/shm")
    with pytest.raises(ValueError, match="fetch_timeout_s"):
        KVTransferConfig(kv_connector="SharedMemoryConnector", kv_role="kv_both",
                         kv_connector_extra_config={"fetch_timeout_s": 1})
    with pytest.raises(ValueError, match="must be positive"):
        _config("kv_producer", max_buffer_bytes=0)


def test_an_offline_llm_cannot_be_a_grpc_producer(tiny_llama_dir: str) -> None:
    from services.offline.llm import LLM

    with pytest.raises(ValueError, match="myvllm serve"):
        LLM(tiny_llama_dir, kv_transfer_config={"kv_connector": "GrpcConnector", "kv_role": "kv_both"})


def test_only_known_producer_workers_are_fetched_from() -> None:
    """The consumer's worker presents the internal token to the producer worker the params name:
    only configured producers (producer_addresses) or, on a served engine with Redis, kv_producer
    entries of the signed registry; any other address is refused naming the field."""
    with pytest.raises(ValueError, match="producer_addresses: 'nowhere' is not host:port"):
        _config("kv_consumer", producer_addresses=["nowhere"])
    with pytest.raises(ValueError, match="producer_addresses has the wrong type"):
        _config("kv_consumer", producer_addresses="10.0.0.1:4000")
    known = {"do_remote_prefill": True, "remote_handle": HANDLE, "remote_num_tokens": 8,
             "remote_block_hash": "00" * 32, "remote_host": "10.0.0.1", "remote_port": 4000}
    elsewhere = params_from_dict({**known, "remote_port": 4001})
    config = _config("kv_consumer", producer_addresses=["10.0.0.1:4000"])
    # The scheduler's check (EngineCore refuses the request with it before anything runs).
    connector = KVConnectorScheduler(config, block_size=4)
    connector.check_source(params_from_dict(known))
    with pytest.raises(ValueError, match=r"kv_transfer_params.remote_host/remote_port '10.0.0.1:4001' is not"):
        connector.check_source(elsewhere)
    unconfigured = KVConnectorScheduler(_config("kv_consumer"), block_size=4)
    assert not unconfigured.knows_source(params_from_dict(known))  # nothing known: nothing allowed
    unconfigured.registry_producers = frozenset({"10.0.0.1:4000"})  # (what the signed registry says)
    assert unconfigured.knows_source(params_from_dict(known)) and not unconfigured.knows_source(elsewhere)
    # The worker's check, again, before it dials anything.
    worker = GrpcConnector(config, LAYOUT, _caches(8, 0), token=TOKEN)
    try:
        worker.check(pb.KVConnectorMetadata(loads=[pb.KVLoad(request_id="r", handle=HANDLE, block_ids=[1],
                                                             block_hashes=[b"\0" * 32], remote_host="10.0.0.1",
                                                             remote_port=4000)]))
        with pytest.raises(InvalidStep, match=r"loads\[0\].*'10.0.0.1:4001' is not a KV producer"):
            worker.check(pb.KVConnectorMetadata(loads=[pb.KVLoad(
                request_id="r", handle=HANDLE, block_ids=[1], block_hashes=[b"\0" * 32], remote_host="10.0.0.1",
                remote_port=4001)]))
    finally:
        worker.close()


def test_the_registry_names_producer_workers_only_in_signed_entries() -> None:
    now = time.time()
    entries = {
        "p": {"address": "s0:1", "num_waiting": 0, "num_running": 0, "ts": now, "kv_role": "kv_producer",
              KV_ADDRESS_FIELD: "w0:2"},
        "c": {"address": "s1:1", "num_waiting": 0, "num_running": 0, "ts": now, "kv_role": "kv_consumer",
              KV_ADDRESS_FIELD: "w1:2"},  # (a consumer's worker serves no KV)
    }
    raw = {k: json.dumps(sign_entry(v, k, TOKEN)) for k, v in entries.items()}
    raw["forged"] = json.dumps({**entries["p"], KV_ADDRESS_FIELD: "evil:2"})  # no MAC

    class Redis:  # (the one call read_engine_loads makes)
        async def hgetall(self, key: str) -> dict:
            return raw

    assert asyncio.run(ProducerRegistry(Redis(), TOKEN).refresh()) == frozenset({"w0:2"})
    with pytest.raises(BadEntry, match="kv_address is not an address"):
        parse_entry(json.dumps({**entries["p"], KV_ADDRESS_FIELD: "w0 :2"}))
    assert kv_producer_addresses({"p": entries["p"], "x": {**entries["p"], "kv_role": ""}}) == frozenset({"w0:2"})
