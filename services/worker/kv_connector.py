"""The KV connector's worker side over shared memory (one host): SharedMemoryConnector.

Producer: after the forward of the step that completed a prompt, its full blocks are gathered
from every layer's cache and written to a segment named by the transfer handle
(services/worker/kv_segment.py), both on a transfer thread while the next steps run (the
scheduler keeps those blocks, and nothing writes them, until the save is reported); the next
answer after it ends reports it (finished_sending). Consumer: a load reads the
segment on the transfer thread, checks it against this engine's layout and the prompt's block
hashes, copies its blocks into the blocks the scheduler allocated (no request of the batch uses
them), and unlinks it; the next answer reports it (finished_recving, or failed_recving: the
request then computes its prompt itself). Steps never wait for a transfer.

Segments live in a tmpfs (/dev/shm where there is one; kv_connector_extra_config.shm_dir). A
producer deletes its own segments that no consumer read within segment_ttl_s, and all of them
when it closes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from services.common.kv_transfer_config import KVTransferConfig
from services.common.proto import myvllm_pb2 as pb
from services.worker.kv_segment import KVLayout, SegmentError, read_segment, segment_path, unlink_quietly, write_segment
from services.worker.step_validation import InvalidStep

logger = logging.getLogger("myvllm.worker.kv_connector")


class Transfer(NamedTuple):
    """How one save or load went: whether it did, its payload bytes, its seconds."""

    ok: bool
    num_bytes: int
    seconds: float


def default_shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def model_id(model_dir: str) -> str:
    """What a segment's "model" says: the model's config.json (same architecture and shapes);
    the directory's path where it has none."""
    try:
        with open(os.path.join(model_dir, "config.json"), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return os.path.realpath(model_dir)


class SharedMemoryConnector:
    def __init__(self, config: KVTransferConfig, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        self.config = config
        self.layout = layout
        self.kv_caches = kv_caches  # per layer [2, num_blocks, block_size, heads, head_dim]
        self.num_blocks = kv_caches[0].shape[1] if kv_caches else 0
        self.directory = config.shm_dir or default_shm_dir()
        self.ttl_s = config.segment_ttl_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-transfer")
        self._lock = threading.Lock()
        # request id -> its save / load, each resolving to a Transfer (a load's .ok False: failed)
        self._saves: dict[str, Future[Transfer]] = {}
        self._loads: dict[str, Future[Transfer]] = {}
        self._own: dict[str, float] = {}      # segments this producer wrote -> when
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        if config.is_producer:
            self._sweeper = threading.Thread(target=self._sweep_loop, name="kv-segment-ttl", daemon=True)
            self._sweeper.start()

    # ------------------------------------------------------------------ one step

    def check(self, meta: pb.KVConnectorMetadata) -> None:
        """InvalidStep unless every block id and handle of `meta` is in range (before anything runs)."""
        try:
            for handle in [e.handle for e in meta.loads] + [e.handle for e in meta.saves] + list(meta.discard_handles):
                segment_path(self.directory, handle)
        except SegmentError as e:
            raise InvalidStep("kv_connector_metadata", str(e)) from None
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
            unlink_quietly(segment_path(self.directory, handle))
        for load in meta.loads:
            self._loads[load.request_id] = self._pool.submit(
                self._load, load.handle, load.first_block, list(load.block_ids), list(load.block_hashes))

    def start_saves(self, meta: pb.KVConnectorMetadata) -> None:
        """After the step's forward (its KV is written, or queued on the device before anything the
        transfer thread queues): gather the saved blocks and write them out on the transfer thread."""
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
        for rid, future in list(self._loads.items()):
            if future.done():
                del self._loads[rid]
                done = future.result()
                (out.finished_recving if done.ok else out.failed_recving).append(rid)
                out.kv_loaded_bytes += done.num_bytes
                out.kv_load_seconds += done.seconds

    # ------------------------------------------------------------------ the transfer thread

    def _save(self, handle: str, block_ids: list[int], hashes: list[bytes]) -> Transfer:
        path = segment_path(self.directory, handle)
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches[0].device)
                layers = [kv.index_select(1, index).to("cpu") for kv in self.kv_caches]
            num_bytes = write_segment(path, self.layout, layers, hashes)
        except Exception:  # noqa: BLE001 - a failed save only means the consumer computes the prompt
            logger.exception("saving KV segment %s failed", handle)
            return Transfer(False, 0, time.perf_counter() - start)
        with self._lock:
            self._own[path] = time.monotonic()
        return Transfer(True, num_bytes, time.perf_counter() - start)

    def _load(self, handle: str, first_block: int, block_ids: list[int], hashes: list[bytes]) -> Transfer:
        path = segment_path(self.directory, handle)
        start = time.perf_counter()
        try:
            # (A prompt's blocks never outnumber a cache that holds max_model_len: both engines'.)
            layers = read_segment(path, self.layout, first_block, hashes, max_blocks=self.num_blocks)
        except SegmentError as e:
            logger.warning("KV segment %s refused: %s", handle, e)
            unlink_quietly(path)
            return Transfer(False, 0, time.perf_counter() - start)
        except Exception:  # noqa: BLE001 - any failure: the request computes its prompt itself
            logger.exception("loading KV segment %s failed", handle)
            unlink_quietly(path)
            return Transfer(False, 0, time.perf_counter() - start)
        unlink_quietly(path)  # read once: its memory goes back now
        with torch.inference_mode():
            index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches[0].device)
            for kv, blocks in zip(self.kv_caches, layers, strict=True):
                kv.index_copy_(1, index, blocks.to(kv.device))
        num_bytes = sum(t.numel() * t.element_size() for t in layers)
        return Transfer(True, num_bytes, time.perf_counter() - start)

    # ------------------------------------------------------------------ lifetime

    def sweep(self, now: float | None = None) -> None:
        """Delete this producer's segments older than segment_ttl_s (nobody came for them)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [p for p, t in self._own.items() if now - t > self.ttl_s]
            for p in expired:
                del self._own[p]
        for p in expired:
            if os.path.exists(p):
                logger.info("KV segment %s expired unread after %.0fs", os.path.basename(p), self.ttl_s)
            unlink_quietly(p)

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
        with self._lock:
            own, self._own = list(self._own), {}
        for p in own:
            unlink_quietly(p)
