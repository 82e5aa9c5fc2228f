"""Which prefix-cache blocks one replica holds, as its KV event stream tells (SubscribeKvEvents).

The index is a set of block hashes: those in the replica's KV cache, and those in its KV tier
(events with a `medium`), from where a prefix hit loads instead of computing, so routing counts
both. A subscription starts with a snapshot that replaces it;
each later batch must carry the next sequence number, else events were lost and the index
can no longer be trusted (`KvEventGap`: the caller resets it and subscribes again). A reset
index knows nothing, so routing treats that replica as having nothing cached.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.proto import myvllm_pb2 as pb


class KvEventGap(RuntimeError):
    """A batch arrived out of sequence: some were lost."""


class PrefixIndex:
    """One replica's cached block hashes."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()
        self.tier: set[bytes] = set()        # the replica's KV tier (kept when its cache is cleared)
        self.seq: int | None = None          # last batch applied; None: not synced
        self.block_size: int | None = None   # tokens per block on that replica (from its batches)

    @property
    def synced(self) -> bool:
        return self.seq is not None

    def reset(self) -> None:
        """Forget everything (the stream broke: until the next snapshot nothing is known)."""
        self.hashes = set()
        self.tier = set()
        self.seq = None

    def apply(self, batch: pb.KvEventBatch) -> None:
        """Apply one batch; raises `KvEventGap` (and leaves the index reset) when a batch is
        missing between the last one applied and this one."""
        if batch.snapshot:
            self.hashes, self.tier = set(), set()
        elif self.seq is None or batch.seq != self.seq + 1:
            expected = "a snapshot" if self.seq is None else f"batch {self.seq + 1}"
            self.reset()
            raise KvEventGap(f"expected {expected}, got batch {batch.seq}")
        if batch.block_size > 0:
            self.block_size = batch.block_size
        for event in batch.events:
            kind = event.WhichOneof("kind")
            if kind == "stored":
                (self.tier if event.stored.medium else self.hashes).add(event.stored.block_hash)
            elif kind == "removed":
                self.hashes.discard(event.removed)
            elif kind == "tier_removed":
                self.tier.discard(event.tier_removed)
            elif kind == "cleared":
                self.hashes.clear()
        self.seq = batch.seq

    def num_leading_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt (its chained hashes) are cached, in the KV cache or
        its tier: the chain means a block is useful only if every block before it is cached too."""
        n = 0
        for block_hash in block_hashes:
            if block_hash not in self.hashes and block_hash not in self.tier:
                break
            n += 1
        return n
