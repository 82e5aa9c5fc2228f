"""KV events: this scheduler's prefix-cache changes, and its KV tier's (their `medium` set),
streamed to gateways (SubscribeKvEvents).

The block pool reports each change as it happens (`stored`, `removed`, `cleared`); the
engine loop calls `flush` once per step, which turns what piled up into one numbered
`KvEventBatch` for every subscriber. A new subscriber first gets a snapshot (every hash
cached now), so a gateway that connects late, or reconnects after missing batches, starts
from the truth. The log keeps its own copy of the cached hashes (with their parents) for
snapshots: it outlives the engine core, which is rebuilt when a different worker comes back.

A subscriber that stops reading is not allowed to grow memory without bound: past
`max_queued_batches` unread batches its stream ends and it must subscribe again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from services.common.proto import myvllm_pb2 as pb

DEFAULT_MAX_QUEUED_BATCHES = 1024


class SubscriberTooSlow(RuntimeError):
    """A subscriber fell more than the allowed number of batches behind."""


class _Subscriber:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[pb.KvEventBatch | None] = asyncio.Queue()  # None: dropped


class KvEventLog:
    """Collects the block pool's hash-map changes and fans them out per step (a KvEventSink)."""

    def __init__(self, block_size: int, max_queued_batches: int = DEFAULT_MAX_QUEUED_BATCHES) -> None:
        self.block_size = block_size
        self.max_queued_batches = max_queued_batches
        self.seq = 0
        self._pending: list[pb.KvEvent] = []
        self._cached: dict[bytes, bytes] = {}  # hash -> parent hash: what a snapshot sends
        self._tier: dict[bytes, str] = {}      # the KV tier's hashes -> their medium (a cleared cache keeps them)
        self._subscribers: set[_Subscriber] = set()

    # ------------------------------------------------------------------ KvEventSink

    def stored(self, block_hash: bytes, parent_hash: bytes) -> None:
        self._cached[block_hash] = parent_hash
        if self._subscribers:  # nobody listening: the snapshot alone will tell a newcomer
            self._pending.append(pb.KvEvent(stored=self._stored(block_hash, parent_hash)))

    def removed(self, block_hash: bytes) -> None:
        self._cached.pop(block_hash, None)
        if self._subscribers:
            self._pending.append(pb.KvEvent(removed=block_hash))

    def cleared(self) -> None:
        """Every KV-cache hash dropped (the tier's stay)."""
        self._cached.clear()
        if self._subscribers:  # what came before it no longer matters, but the tier's changes
            self._pending = [e for e in self._pending if e.WhichOneof("kind") == "tier_removed"
                             or (e.WhichOneof("kind") == "stored" and e.stored.medium)]
            self._pending.insert(0, pb.KvEvent(cleared=True))

    # ------------------------------------------------------------------ the KV tier's changes

    def tier_stored(self, block_hash: bytes, medium: str) -> None:
        """The KV tier holds `block_hash` now (services/engine/kv_tier.py, from its worker's reports)."""
        if self._tier.get(block_hash) == medium:
            return
        self._tier[block_hash] = medium
        if self._subscribers:
            self._pending.append(pb.KvEvent(stored=self._stored(block_hash, b"", medium)))

    def tier_removed(self, block_hash: bytes) -> None:
        if self._tier.pop(block_hash, None) is not None and self._subscribers:
            self._pending.append(pb.KvEvent(tier_removed=block_hash))

    def _stored(self, block_hash: bytes, parent_hash: bytes, medium: str = "") -> pb.KvBlockStored:
        return pb.KvBlockStored(block_hash=block_hash, parent_hash=parent_hash, block_size=self.block_size,
                                medium=medium)

    # ------------------------------------------------------------------ fan-out

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def flush(self) -> None:
        """Send what this step changed as one batch (nothing when nothing changed)."""
        if not self._pending:
            return
        self.seq += 1
        batch = pb.KvEventBatch(seq=self.seq, events=self._pending, block_size=self.block_size)
        self._pending = []
        for sub in list(self._subscribers):
            if sub.queue.qsize() >= self.max_queued_batches:
                self._drop(sub)
            else:
                sub.queue.put_nowait(batch)

    def _drop(self, sub: _Subscriber) -> None:
        self._subscribers.discard(sub)
        while not sub.queue.empty():  # free the backlog now, not when the stream notices
            sub.queue.get_nowait()
        sub.queue.put_nowait(None)

    def snapshot(self) -> pb.KvEventBatch:
        """Every hash cached now, as of batch `seq` (pending changes included: replaying them
        from the next batch is harmless)."""
        events = [pb.KvEvent(stored=self._stored(h, p)) for h, p in self._cached.items()]
        events += [pb.KvEvent(stored=self._stored(h, b"", medium)) for h, medium in self._tier.items()]
        return pb.KvEventBatch(seq=self.seq, snapshot=True, block_size=self.block_size, events=events)

    async def subscribe(self) -> AsyncIterator[pb.KvEventBatch]:
        """The snapshot, then every batch, until the caller stops iterating. Raises
        `SubscriberTooSlow` when the caller fell too far behind."""
        sub = _Subscriber()
        self._subscribers.add(sub)
        try:
            yield self.snapshot()
            while True:
                batch = await sub.queue.get()
                if batch is None:
                    raise SubscriberTooSlow(f"more than {self.max_queued_batches} KV event batches unread")
                yield batch
        finally:
            self._subscribers.discard(sub)
