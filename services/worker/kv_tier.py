"""The KV tier's worker side (--kv-offloading-size, backend "native"): KV blocks kept beyond the
pool, addressed by their chained prefix hash, and loaded back into the cache on a prefix hit
(services/engine/kv_tier.py is the scheduler's side). Two storages: `FileTier`, a directory on
local disk, one file per block (the CPU default, and wherever --kv-offloading-dir is given): the
files outlive the worker, so requests migrated to a restarted worker load their prefixes instead
of recomputing them; `HostTier`, pinned host memory (a GPU's default, as vLLM's native CPU
offloading), gone with the worker.

- Stores and offers: after the step's forward, the blocks it filled; before it (the forward may
  write new KV into them), the blocks the pool evicted that the tier lacks. Their KV is copied
  out of the cache; a writer thread writes each as a one-block segment (kv_segment.py: the
  model's identity, dtype and layout, the block's hash and a CRC-32 in its header; owner-only,
  written under a temporary name and renamed). The copies waiting for the writer are bounded
  (MAX_PENDING_BYTES): past it an offer is dropped and counted, never waited for.
- Loads: on a load thread, like a P/D consumer's: each file is read and checked (owner, size,
  model, layout, hash, CRC) before a byte reaches the cache; a file that fails is deleted and
  reported gone, and the request computes its prompt instead.
- Capacity: the directory holds at most kv_offloading_size GiB; the least recently stored or
  loaded files go first (a load touches its file's mtime, so the order survives a restart).
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from services.common.kv_transfer_params import HASH_BYTES
from services.common.proto import myvllm_pb2 as pb
from services.worker.kv_connector import Transfer, report_loads
from services.worker.kv_segment import (
    TMP_MARK,
    KVLayout,
    SegmentError,
    max_segment_bytes,
    read_segment,
    unlink_quietly,
    write_segment,
)
from services.worker.step_validation import InvalidStep

logger = logging.getLogger("myvllm.worker.kv_tier")

SUFFIX = ".kvb"
_NAME_RE = re.compile(rf"^[0-9a-f]{{{2 * HASH_BYTES}}}{re.escape(SUFFIX)}$")
# Copies of offered blocks waiting for the writer thread, at most (a burst of evictions beyond it
# is dropped: the step never waits for the disk).
MAX_PENDING_BYTES = 256 << 20
GIB = 1 << 30


def default_tier_dir(model_digest: str, block_size: int, data_parallel_rank: int) -> str:
    """~/.cache/myvllm/kv-tier/<model digest>-bs<block size>-dp<rank> (XDG_CACHE_HOME honoured):
    one directory per engine, so that two engines never share one's capacity and LRU."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "myvllm", "kv-tier", f"{model_digest[:16]}-bs{block_size}-dp{data_parallel_rank}")


class KVTier:
    """What both storages share: the LRU by bytes, the writer and load threads, the checks of a
    step's metadata, the reports. A storage keeps a block (`_put`, its bytes), gives it back
    checked (`_get`, SegmentError otherwise) and deletes it (`_delete`)."""

    def __init__(self, capacity_bytes: int, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        self.capacity_bytes = capacity_bytes
        self.layout = layout
        self.kv_caches = kv_caches  # per layer [2, num_blocks, block_size, heads, head_dim]
        self.num_blocks = kv_caches[0].shape[1] if kv_caches else 0
        self._lock = threading.Lock()
        self._held: OrderedDict[bytes, int] = OrderedDict()  # hash -> its bytes (file or memory), least recent first
        self._bytes = 0
        self._stored: list[bytes] = []    # reports since the last answer
        self._removed: list[bytes] = []
        self._dropped = 0
        self._pending_bytes = 0
        self._writing: set[bytes] = set()  # hashes copied out, not kept yet
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier-write")
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier-load")
        self._loads: dict[str, Future[Transfer]] = {}

    def _put(self, block_hash: bytes, layers: list[torch.Tensor]) -> int:
        raise NotImplementedError

    def _get(self, block_hash: bytes) -> list[torch.Tensor]:
        raise NotImplementedError

    def _delete(self, block_hash: bytes) -> None:
        raise NotImplementedError

    def _touch(self, block_hash: bytes) -> None:
        """(A storage that keeps the LRU order across restarts records a use.)"""

    # ------------------------------------------------------------------ one step

    def check(self, meta: pb.KVConnectorMetadata) -> None:
        """InvalidStep unless every block id and hash of `meta` is well formed (before anything runs)."""
        if meta.saves or meta.discard_handles:
            raise InvalidStep("kv_connector_metadata", "P/D saves or discards sent to a KV tier")
        for ids, hashes in (("offload_block_ids", "offload_block_hashes"), ("store_block_ids", "store_block_hashes")):
            if len(getattr(meta, ids)) != len(getattr(meta, hashes)):
                raise InvalidStep(f"kv_connector_metadata.{ids}", f"differs in length from {hashes}")
        entries = [("offload_block_ids", meta.offload_block_ids, meta.offload_block_hashes),
                   ("store_block_ids", meta.store_block_ids, meta.store_block_hashes)]
        entries += [(f"loads[{i}]", e.block_ids, e.block_hashes) for i, e in enumerate(meta.loads)]
        for where, ids, hashes in entries:
            if where.startswith("loads") and (not ids or len(ids) != len(hashes)):
                raise InvalidStep(f"kv_connector_metadata.{where}", "block_ids and block_hashes differ in length")
            if ids and (min(ids) < 1 or max(ids) >= self.num_blocks):
                raise InvalidStep(f"kv_connector_metadata.{where}", f"a block id outside [1, {self.num_blocks})")
            if any(len(h) != HASH_BYTES for h in hashes):
                raise InvalidStep(f"kv_connector_metadata.{where}", f"a block hash is not {HASH_BYTES} bytes")
        for i, load in enumerate(meta.loads):
            if load.handle or load.remote_host:
                raise InvalidStep(f"kv_connector_metadata.loads[{i}]", "a KV tier load names no segment or host")

    def start_loads(self, meta: pb.KVConnectorMetadata) -> None:
        """Before the step's forward: copy the evicted blocks' KV out (the forward and this step's
        loads may write into them), then start the loads."""
        if meta.offload_block_ids:
            self._offer(list(meta.offload_block_ids), list(meta.offload_block_hashes))
        for load in meta.loads:
            self._loads[load.request_id] = self._loader.submit(self._load, load)

    def start_saves(self, meta: pb.KVConnectorMetadata, left_out: frozenset[int] = frozenset()) -> None:
        """After the step's forward: copy out the blocks it filled, but those of requests the step
        left out (`left_out`: their KV was never computed)."""
        keep = [(b, h) for b, h in zip(meta.store_block_ids, meta.store_block_hashes, strict=True)
                if b not in left_out]
        if keep:
            self._offer([b for b, _ in keep], [h for _, h in keep])

    def report(self, out: pb.ModelRunnerOutput) -> None:
        """Put the loads that ended and the tier's changes since the last answer into `out`."""
        report_loads(self._loads, out)
        with self._lock:  # (what is held now: a block stored and dropped since is reported gone)
            out.kv_tier_stored.extend(dict.fromkeys(h for h in self._stored if h in self._held))
            out.kv_tier_removed.extend(dict.fromkeys(h for h in self._removed if h not in self._held))
            out.kv_tier_offers_dropped += self._dropped
            self._stored, self._removed, self._dropped = [], [], 0

    # ------------------------------------------------------------------ offers (the step's thread)

    def _offer(self, block_ids: list[int], hashes: list[bytes]) -> None:
        per_block = self.layout.num_layers * self.layout.block_bytes_per_layer
        keep = [(b, h) for b, h in zip(block_ids, hashes, strict=True)
                if h not in self._held and h not in self._writing]
        room = max(0, (MAX_PENDING_BYTES - self._pending_bytes) // per_block)
        if len(keep) > room:
            with self._lock:
                self._dropped += len(keep) - room
            keep = keep[:room]
        if not keep:
            return
        with torch.inference_mode():
            index = torch.tensor([b for b, _ in keep], dtype=torch.long, device=self.kv_caches[0].device)
            layers = [kv.index_select(1, index).to("cpu") for kv in self.kv_caches]
        with self._lock:
            self._pending_bytes += len(keep) * per_block
            self._writing.update(h for _, h in keep)
        self._writer.submit(self._write, [h for _, h in keep], layers, per_block)

    # ------------------------------------------------------------------ the writer thread

    def _write(self, hashes: list[bytes], layers: list[torch.Tensor], per_block: int) -> None:
        try:
            for i, block_hash in enumerate(hashes):
                try:
                    size = self._put(block_hash, [t[:, i:i + 1] for t in layers])
                except (OSError, RuntimeError) as e:  # a full disk, no pinned memory: the block is not kept
                    logger.warning("KV tier: writing a block failed (%s)", e)
                    continue
                with self._lock:
                    if block_hash in self._held:
                        self._bytes -= self._held[block_hash]
                    self._held[block_hash] = size
                    self._held.move_to_end(block_hash)
                    self._bytes += size
                    self._stored.append(block_hash)
                    self._evict_over_capacity()
        finally:
            with self._lock:
                self._pending_bytes -= len(hashes) * per_block
                self._writing.difference_update(hashes)

    def _evict_over_capacity(self) -> None:
        """(Under the lock, or before the threads start.) Delete the least recent files past the capacity."""
        while self._bytes > self.capacity_bytes and self._held:
            block_hash, size = self._held.popitem(last=False)
            self._bytes -= size
            self._delete(block_hash)
            self._removed.append(block_hash)

    def _forget(self, block_hash: bytes) -> None:
        """A file that failed its checks: deleted, reported gone."""
        with self._lock:
            size = self._held.pop(block_hash, None)
            if size is not None:
                self._bytes -= size
            self._removed.append(block_hash)
        self._delete(block_hash)

    # ------------------------------------------------------------------ the load thread

    def _load(self, load: pb.KVLoad) -> Transfer:
        start = time.perf_counter()
        blocks: list[list[torch.Tensor]] = []
        for block_hash in load.block_hashes:
            try:
                blocks.append(self._get(block_hash))
            except SegmentError as e:
                logger.warning("KV tier block %s refused: %s", block_hash.hex()[:16], e)
                self._forget(block_hash)
                return Transfer(False, 0, time.perf_counter() - start)
        try:
            with torch.inference_mode():
                index = torch.tensor(list(load.block_ids), dtype=torch.long, device=self.kv_caches[0].device)
                for layer, kv in enumerate(self.kv_caches):
                    kv.index_copy_(1, index, torch.cat([b[layer] for b in blocks], dim=1).to(kv.device))
        except Exception:  # noqa: BLE001 - any failure: the request computes its prompt itself
            logger.exception("KV tier: copying loaded blocks into the cache failed")
            return Transfer(False, 0, time.perf_counter() - start)
        with self._lock:
            for block_hash in load.block_hashes:
                if block_hash in self._held:
                    self._held.move_to_end(block_hash)
        for block_hash in load.block_hashes:
            self._touch(block_hash)
        num_bytes = sum(t.numel() * t.element_size() for b in blocks for t in b)
        return Transfer(True, num_bytes, time.perf_counter() - start)

    # ------------------------------------------------------------------ lifetime

    def reset(self) -> None:
        """Forget every load (the scheduler forgets them too): wait for the thread's jobs. The
        files stay."""
        for future in list(self._loads.values()):
            future.exception()
        self._loads.clear()

    def close(self) -> None:
        """Finish the writes in flight (their blocks are kept) and stop the threads."""
        self._writer.shutdown(wait=True)
        self._loader.shutdown(wait=True)


class FileTier(KVTier):
    """Blocks as files in a directory on local disk: they outlive the worker."""

    def __init__(self, directory: str, capacity_bytes: int, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        super().__init__(capacity_bytes, layout, kv_caches)
        self.directory = directory
        self.file_limit = max_segment_bytes(layout, 1)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise ValueError(f"--kv-offloading-dir {directory} is not a directory this user owns")
        self._scan()

    def path(self, block_hash: bytes) -> str:
        return os.path.join(self.directory, block_hash.hex() + SUFFIX)

    def _scan(self) -> None:
        """Adopt the files a previous worker left (oldest first), reported as stored with the next
        answer; remove half-written ones and what is too large to be a block of this layout."""
        found = []
        for name in os.listdir(self.directory):
            full = os.path.join(self.directory, name)
            if TMP_MARK in name:
                unlink_quietly(full)  # a write its worker never finished
                continue
            if not _NAME_RE.match(name):
                continue
            try:
                st = os.lstat(full)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > self.file_limit:
                continue  # (never loaded: read_segment refuses it too)
            found.append((st.st_mtime, bytes.fromhex(name[:-len(SUFFIX)]), st.st_size))
        for _, block_hash, size in sorted(found):
            self._held[block_hash] = size
            self._bytes += size
        self._stored.extend(self._held)
        self._evict_over_capacity()
        if found:
            logger.info("KV tier %s: %d block(s) (%.1f MiB) from before", self.directory, len(self._held),
                        self._bytes / 2**20)

    def _put(self, block_hash: bytes, layers: list[torch.Tensor]) -> int:
        return write_segment(self.path(block_hash), self.layout, layers, [block_hash])

    def _get(self, block_hash: bytes) -> list[torch.Tensor]:
        return read_segment(self.path(block_hash), self.layout, 0, [block_hash], max_blocks=1)

    def _delete(self, block_hash: bytes) -> None:
        unlink_quietly(self.path(block_hash))

    def _touch(self, block_hash: bytes) -> None:
        now = time.time()
        try:
            os.utime(self.path(block_hash), (now, now))  # (the LRU order, for a restarted worker)
        except OSError:
            pass


class HostTier(KVTier):
    """Blocks in host memory (pinned where the cache is on a GPU, so that copies to it run
    asynchronously): vLLM's native CPU offloading. Gone with the worker."""

    def __init__(self, capacity_bytes: int, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        super().__init__(capacity_bytes, layout, kv_caches)
        self._pin = bool(kv_caches) and kv_caches[0].is_cuda
        self._blocks: dict[bytes, list[torch.Tensor]] = {}

    def _put(self, block_hash: bytes, layers: list[torch.Tensor]) -> int:
        kept = [t.clone().pin_memory() if self._pin else t.clone() for t in layers]
        with self._lock:
            self._blocks[block_hash] = kept
        return sum(t.numel() * t.element_size() for t in kept)

    def _get(self, block_hash: bytes) -> list[torch.Tensor]:
        with self._lock:
            layers = self._blocks.get(block_hash)
        if layers is None:
            raise SegmentError("not in the host tier (dropped since)")
        return layers

    def _delete(self, block_hash: bytes) -> None:
        self._blocks.pop(block_hash, None)


def tier_capacity_bytes(size_gib: float) -> int:
    return int(size_gib * GIB)
