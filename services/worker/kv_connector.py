"""The KV connector's worker side: SharedMemoryConnector (one host) and GrpcConnector (any hosts).

Producer: after the forward of the step that completed a prompt, its full blocks are gathered
from every layer's cache and stored as a segment named by the transfer handle
(services/worker/kv_segment.py), both on a transfer thread while the next steps run (the
scheduler keeps those blocks, and nothing writes them, until the save is reported); the next
answer after it ends reports it (finished_sending). Consumer: a load fetches the segment on a
transfer thread, checks it against this engine's layout and the prompt's block hashes, copies its
blocks into the blocks the scheduler allocated (no request of the batch uses them); the next
answer reports it (finished_recving, or failed_recving: the request then computes its prompt
itself). Steps never wait for a transfer. A segment is read once: it is gone afterwards.

Where segments live is the transport:
- SharedMemoryConnector: files in a tmpfs (/dev/shm where there is one;
  kv_connector_extra_config.shm_dir) that producer and consumer share; no copy beyond the two.
- GrpcConnector: the producer's worker keeps them in its memory (at most max_buffer_bytes) and
  streams them to the consumer's worker over its own gRPC server (Worker.FetchKV, in chunks,
  with the internal token), which dials the producer worker's address the params carry; the
  consumer waits at most fetch_timeout_s. Chosen over torch.distributed send/recv: replicas come
  and go (a process group's membership is fixed at init, and a member's death breaks the group),
  each transfer is one authenticated stream between two workers that fails alone, and the mesh
  already speaks gRPC everywhere (its cost against shared memory: BENCHMARKS.md, "Prefill/decode
  disaggregation").
A producer deletes its own segments that no consumer read within segment_ttl_s, and all of them
when it closes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import grpc
import torch

from services.common import grpc_utils
from services.common.auth import token_metadata
from services.common.kv_transfer_config import KVTransferConfig
from services.common.kv_transfer_params import HANDLE_RE, HASH_BYTES, check_params, check_source
from services.common.proto import myvllm_pb2 as pb
from services.common.proto import myvllm_pb2_grpc as pb_grpc
from services.worker.kv_segment import (
    KVLayout,
    SegmentError,
    decode_segment,
    encode_segment,
    max_segment_bytes,
    read_segment,
    segment_path,
    sweep_stale,
    unlink_quietly,
    write_segment,
)
from services.worker.step_validation import InvalidStep

logger = logging.getLogger("myvllm.worker.kv_connector")

# A FetchKV answer's bytes per message (well under gRPC's default message limits).
FETCH_CHUNK_BYTES = 1 << 20
# The model identity's weight samples (model_id): per file, how many and how long. 256 reads of
# 4 KiB cost milliseconds (the files were just read to load them) and miss no full fine-tune.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
WEIGHT_SAMPLES = 256
WEIGHT_SAMPLE_BYTES = 4096


class Transfer(NamedTuple):
    """How one save or load went: whether it did, its payload bytes, its seconds."""

    ok: bool
    num_bytes: int
    seconds: float


def report_loads(loads: dict[str, Future[Transfer]], out: pb.ModelRunnerOutput) -> None:
    """Move the loads that ended from `loads` into `out` (finished or failed, bytes, seconds): a
    P/D consumer's and the KV tier's alike."""
    for rid, future in list(loads.items()):
        if future.done():
            del loads[rid]
            done = future.result()
            (out.finished_recving if done.ok else out.failed_recving).append(rid)
            out.kv_loaded_bytes += done.num_bytes
            out.kv_load_seconds += done.seconds


def default_shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def model_id(model_dir: str, kv_dtype: torch.dtype) -> str:
    """What a segment's "model" says: a digest of what makes two engines' KV interchangeable. The
    model's config.json (architecture and shapes; the directory's path where it has none), the
    KV dtype, and the weights: each weight file's name and size, a safetensors file's header
    (tensor names, dtypes, shapes, data offsets), and WEIGHT_SAMPLES evenly spaced samples of its
    bytes. Two fine-tunes of one base share config and headers but differ throughout their
    tensors: the samples tell them apart, at the cost of a few reads, not a pass over the weights.
    Computed once per cache (Worker.init_kv_cache)."""
    digest = hashlib.sha256(f"kv_dtype={str(kv_dtype).removeprefix('torch.')}\n".encode())
    try:
        with open(os.path.join(model_dir, "config.json"), "rb") as f:
            digest.update(f.read())
    except OSError:
        digest.update(os.path.realpath(model_dir).encode())
    try:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(WEIGHT_SUFFIXES))
    except OSError:
        names = []
    for name in names:
        try:
            with open(os.path.join(model_dir, name), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                digest.update(f"\n{name} {size}\n".encode())
                start = 0
                if name.endswith(".safetensors") and size >= 8:
                    header_len = int.from_bytes(f.read(8), "little")
                    start = 8 + min(header_len, size - 8)
                    digest.update(f.read(start - 8))
                span = size - start
                for i in range(WEIGHT_SAMPLES if span > 0 else 0):
                    f.seek(start + span * i // WEIGHT_SAMPLES)
                    digest.update(f.read(WEIGHT_SAMPLE_BYTES))
        except OSError as e:
            digest.update(f"{name}: {e.strerror}".encode())
    return digest.hexdigest()[:32]


class KVConnectorWorker:
    """What both transports share: the transfer thread, the reports, the checks, the lifetime.
    A transport stores a segment (`_store`), fetches one (`_fetch`) and drops one (`_drop`)."""

    def __init__(self, config: KVTransferConfig, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        self.config = config
        self.layout = layout
        self.kv_caches = kv_caches  # per layer [2, num_blocks, block_size, heads, head_dim]
        self.num_blocks = kv_caches[0].shape[1] if kv_caches else 0
        self.ttl_s = config.segment_ttl_s
        # Saves and loads on threads of their own: a slow fetch never holds up a save (kv_both).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-save")
        self._load_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-load")
        self._lock = threading.Lock()
        # request id -> its save / load, each resolving to a Transfer (a load's .ok False: failed)
        self._saves: dict[str, Future[Transfer]] = {}
        self._loads: dict[str, Future[Transfer]] = {}
        self._own: dict[str, float] = {}      # handles of segments this producer stored -> when
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        if config.is_producer:
            self._sweeper = threading.Thread(target=self._sweep_loop, name="kv-segment-ttl", daemon=True)
            self._sweeper.start()

    # ------------------------------------------------------------------ one step

    def check(self, meta: pb.KVConnectorMetadata) -> None:
        """InvalidStep unless every block id and handle of `meta` is in range (before anything runs)."""
        for handle in [e.handle for e in meta.loads] + [e.handle for e in meta.saves] + list(meta.discard_handles):
            if not HANDLE_RE.match(handle):
                raise InvalidStep("kv_connector_metadata", f"{handle[:80]!r} is not a transfer handle")
        for i, load in enumerate(meta.loads):
            try:
                self._check_source(load)
            except ValueError as e:
                raise InvalidStep(f"kv_connector_metadata.loads[{i}]", str(e)) from None
        for entries, what in ((meta.loads, "loads"), (meta.saves, "saves")):
            for i, e in enumerate(entries):
                if not e.block_ids or len(e.block_ids) != len(e.block_hashes):
                    raise InvalidStep(f"kv_connector_metadata.{what}[{i}]",
                                      "block_ids and block_hashes differ in length")
                if min(e.block_ids) < 1 or max(e.block_ids) >= self.num_blocks:
                    raise InvalidStep(f"kv_connector_metadata.{what}[{i}].block_ids", f"outside [1, {self.num_blocks})")
        if meta.loads and not self.config.is_consumer:
            raise InvalidStep("kv_connector_metadata.loads", "sent to a kv_producer")
        if meta.saves and not self.config.is_producer:
            raise InvalidStep("kv_connector_metadata.saves", "sent to a kv_consumer")

    def start_loads(self, meta: pb.KVConnectorMetadata) -> None:
        """Before the step's forward: start its loads (into blocks no scheduled request uses) and
        drop the segments no load needs."""
        for handle in meta.discard_handles:
            self._drop(handle)
        for load in meta.loads:
            self._loads[load.request_id] = self._load_pool.submit(self._load, load)

    def start_saves(self, meta: pb.KVConnectorMetadata, left_out: frozenset[int] = frozenset()) -> None:
        """After the step's forward (its KV is written, or queued on the device before anything the
        transfer thread queues): gather the saved blocks and write them out on the transfer thread.
        (`left_out`: blocks of requests the step left out; a P/D save is its request's, which the
        scheduler ends, so it is discarded unread.)"""
        for save in meta.saves:
            self._saves[save.request_id] = self._pool.submit(
                self._save, save.handle, list(save.block_ids), list(save.block_hashes))

    def report(self, out: pb.ModelRunnerOutput) -> None:
        """Put the transfers that ended since the last answer into `out`."""
        for rid, future in list(self._saves.items()):
            if future.done():
                del self._saves[rid]
                out.finished_sending.append(rid)
                done = future.result()
                out.kv_saved_bytes += done.num_bytes
                out.kv_save_seconds += done.seconds
        report_loads(self._loads, out)

    # ------------------------------------------------------------------ the transfer thread

    def _save(self, handle: str, block_ids: list[int], hashes: list[bytes]) -> Transfer:
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches[0].device)
                layers = [kv.index_select(1, index).to("cpu") for kv in self.kv_caches]
            num_bytes = self._store(handle, layers, hashes)
        except Exception:  # noqa: BLE001 - a failed save only means the consumer computes the prompt
            logger.exception("saving KV segment %s failed", handle)
            return Transfer(False, 0, time.perf_counter() - start)
        with self._lock:
            self._own[handle] = time.monotonic()
        return Transfer(True, num_bytes, time.perf_counter() - start)

    def _load(self, load: pb.KVLoad) -> Transfer:
        start = time.perf_counter()
        try:
            # (A prompt's blocks never outnumber a cache that holds max_model_len: both engines'.)
            layers = self._fetch(load)
            # A copy that fails (device memory, a device error) fails this request's load only: its
            # blocks are its own, and it computes its prompt itself (overwriting whatever was copied).
            with torch.inference_mode():
                index = torch.tensor(list(load.block_ids), dtype=torch.long, device=self.kv_caches[0].device)
                for kv, blocks in zip(self.kv_caches, layers, strict=True):
                    kv.index_copy_(1, index, blocks.to(kv.device))
        except SegmentError as e:
            logger.warning("KV segment %s refused: %s", load.handle, e)
            return Transfer(False, 0, time.perf_counter() - start)
        except Exception:  # noqa: BLE001 - any failure: the request computes its prompt itself
            logger.exception("loading KV segment %s failed", load.handle)
            return Transfer(False, 0, time.perf_counter() - start)
        num_bytes = sum(t.numel() * t.element_size() for t in layers)
        return Transfer(True, num_bytes, time.perf_counter() - start)

    # ------------------------------------------------------------------ the transport

    def _check_source(self, load: pb.KVLoad) -> None:
        """ValueError unless this transport can fetch from where `load` says."""
        raise NotImplementedError

    def _store(self, handle: str, layers: list[torch.Tensor], hashes: list[bytes]) -> int:
        """Keep the segment for its consumer; its bytes."""
        raise NotImplementedError

    def _fetch(self, load: pb.KVLoad) -> list[torch.Tensor]:
        """The blocks `load` asks for, checked (SegmentError otherwise); the segment is gone after."""
        raise NotImplementedError

    def _drop(self, handle: str) -> bool:
        """Delete a segment (nobody will read it), if this side can; whether there was one."""
        raise NotImplementedError

    # ------------------------------------------------------------------ lifetime

    def sweep(self, now: float | None = None) -> None:
        """Delete this producer's segments older than segment_ttl_s (nobody came for them)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [h for h, t in self._own.items() if now - t > self.ttl_s]
            for h in expired:
                del self._own[h]
        for h in expired:
            if self._drop(h):
                logger.info("KV segment %s expired unread after %.0fs", h, self.ttl_s)

    def _sweep_loop(self) -> None:
        while not self._stop.wait(min(self.ttl_s / 4, 5.0)):
            self.sweep()

    def reset(self) -> None:
        """Forget every transfer (the scheduler forgets them too): wait for the thread's jobs."""
        for future in list(self._saves.values()) + list(self._loads.values()):
            future.exception()  # (waits; never raises: the jobs catch their errors)
        self._saves.clear()
        self._loads.clear()

    def close(self) -> None:
        """Stop the transfer thread and delete every segment this producer wrote."""
        self._stop.set()
        self._pool.shutdown(wait=True)
        self._load_pool.shutdown(wait=True)
        with self._lock:
            own, self._own = list(self._own), {}
        for h in own:
            self._drop(h)


class SharedMemoryConnector(KVConnectorWorker):
    """Segments as files in a tmpfs that both engines' workers see."""

    def __init__(self, config: KVTransferConfig, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        self.directory = config.shm_dir or default_shm_dir()
        # What producers that died (killed, crashed) left behind: nobody else would delete it.
        removed = sweep_stale(self.directory)
        if removed:
            logger.info("removed %d KV segment file(s) of dead producers from %s", len(removed), self.directory)
        super().__init__(config, layout, kv_caches)

    def _check_source(self, load: pb.KVLoad) -> None:
        if load.remote_host:
            raise ValueError("a remote_host load for a SharedMemoryConnector (the producer runs GrpcConnector?)")

    def _store(self, handle: str, layers: list[torch.Tensor], hashes: list[bytes]) -> int:
        return write_segment(segment_path(self.directory, handle), self.layout, layers, hashes)

    def _fetch(self, load: pb.KVLoad) -> list[torch.Tensor]:
        path = segment_path(self.directory, load.handle)
        try:
            return read_segment(path, self.layout, load.first_block, list(load.block_hashes),
                                max_blocks=self.num_blocks)
        finally:
            unlink_quietly(path)  # read once (or refused): its memory goes back now

    def _drop(self, handle: str) -> bool:
        path = segment_path(self.directory, handle)
        existed = os.path.exists(path)
        unlink_quietly(path)
        return existed


class GrpcConnector(KVConnectorWorker):
    """Segments in the producer worker's memory, fetched by consumers over its gRPC server."""

    def __init__(self, config: KVTransferConfig, layout: KVLayout, kv_caches: list[torch.Tensor],
                 token: str | None = None) -> None:
        self.token = token  # the mesh's internal token: the producer's worker asks for it
        self._buffer: dict[str, bytes] = {}  # handle -> segment (producer)
        self._buffer_bytes = 0
        self._buffer_lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}  # producer address -> channel (consumer)
        super().__init__(config, layout, kv_caches)

    def _check_source(self, load: pb.KVLoad) -> None:
        if not load.remote_host:
            raise ValueError("no remote_host: a GrpcConnector fetches from the producer's worker")
        params = pb.KVTransferParams(do_remote_prefill=True, remote_handle=load.handle,
                                     remote_block_hash=b"\0" * HASH_BYTES, remote_host=load.remote_host,
                                     remote_port=load.remote_port)
        check_params(params)
        if self.config.producer_addresses:  # (configured: checked again here, before the token goes out)
            check_source(params, self.config.producer_addresses)

    def _store(self, handle: str, layers: list[torch.Tensor], hashes: list[bytes]) -> int:
        data = b"".join(encode_segment(self.layout, layers, hashes))
        with self._buffer_lock:
            if self._buffer_bytes + len(data) > self.config.max_buffer_bytes:
                raise RuntimeError(f"{self._buffer_bytes} bytes of segments held: a {len(data)}-byte segment "
                                   f"would pass max_buffer_bytes {self.config.max_buffer_bytes}")
            self._buffer[handle] = data
            self._buffer_bytes += len(data)
        return len(data)

    def take(self, handle: str) -> bytes | None:
        """A stored segment, handed out once (Worker.FetchKV); None if there is none by that handle."""
        with self._buffer_lock:
            data = self._buffer.pop(handle, None)
            if data is not None:
                self._buffer_bytes -= len(data)
        return data

    def _drop(self, handle: str) -> bool:
        return self.take(handle) is not None

    def _fetch(self, load: pb.KVLoad) -> list[torch.Tensor]:
        address = f"{load.remote_host}:{load.remote_port}"
        limit = max_segment_bytes(self.layout, self.num_blocks)
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc_utils.sync_channel(address, FETCH_CHUNK_BYTES + 1024)
        stub = pb_grpc.WorkerStub(channel)
        data = bytearray()
        try:
            for chunk in stub.FetchKV(pb.KVFetchRequest(handle=load.handle), timeout=self.config.fetch_timeout_s,
                                      metadata=token_metadata(self.token)):
                data += chunk.data
                if len(data) > limit:
                    raise SegmentError(f"more than {limit} bytes: more than a segment of {self.num_blocks} blocks")
        except grpc.RpcError as e:
            raise SegmentError(f"fetching it from {address}: {e.code().name}: {e.details()}") from None
        return decode_segment(data, self.layout, load.first_block, list(load.block_hashes), self.num_blocks)

    def close(self) -> None:
        super().close()
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


def serve_segment(connector: KVConnectorWorker | None, handle: str) -> Iterator[pb.KVChunk]:
    """Worker.FetchKV's answer: the segment in chunks (KeyError if there is none by that handle)."""
    data = connector.take(handle) if isinstance(connector, GrpcConnector) else None
    if data is None:
        raise KeyError(handle)
    view = memoryview(data)
    for start in range(0, len(view), FETCH_CHUNK_BYTES):
        yield pb.KVChunk(data=bytes(view[start:start + FETCH_CHUNK_BYTES]))


def make_connector(config: KVTransferConfig, layout: KVLayout, kv_caches: list[torch.Tensor],
                   token: str | None = None) -> KVConnectorWorker:
    """The worker side of `config.kv_connector`."""
    if config.kv_connector == "GrpcConnector":
        return GrpcConnector(config, layout, kv_caches, token)
    return SharedMemoryConnector(config, layout, kv_caches)
