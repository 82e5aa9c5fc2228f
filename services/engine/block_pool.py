"""The KV block pool: block metadata, the free list and the prefix-cache hash map.

Block 0 is the null block and is never handed out. Free blocks sit in a doubly linked
list with sentinel head and tail, so a cached block that gets a prefix-cache hit can be
unlinked from the middle in O(1). Allocation pops from the head; on free, blocks without
a hash go to the head (reused first) and hashed blocks go to the tail (kept longest: the
list is an LRU of cached blocks). A block handed out again loses its hash.

Every change to the hash map (a hash cached, one dropped, all cleared) is told to `events`
when set: the scheduler publishes them as KV events so gateways can route by cached prefix. A
cached block evicted to be reused is told to `on_evict` when set, before it loses its hash, and
a block newly cached to `on_cache`: the KV tier (services/engine/kv_tier.py) keeps their KV.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol


class KvEventSink(Protocol):
    """Where the pool reports changes of its hash map (services/scheduler/kv_events.py)."""

    def stored(self, block_hash: bytes, parent_hash: bytes) -> None: ...

    def removed(self, block_hash: bytes) -> None: ...

    def cleared(self) -> None: ...


class KVBlock:
    """Metadata of one physical KV block (the tensors live in the worker)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels; every operation is O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self.head = KVBlock(-1)
        self.tail = KVBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def _link_between(self, block: KVBlock, prev: KVBlock, nxt: KVBlock) -> None:
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def append(self, block: KVBlock) -> None:
        """Put `block` at the tail (evicted last)."""
        self._link_between(block, self.tail.prev_free, self.tail)

    def appendleft(self, block: KVBlock) -> None:
        """Put `block` at the head (reused first)."""
        self._link_between(block, self.head, self.head.next_free)

    def remove(self, block: KVBlock) -> None:
        """Unlink `block` from wherever it sits."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free list")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVBlock:
        block = self.head.next_free
        if block is self.tail:
            raise RuntimeError("no free blocks")
        self.remove(block)
        return block

    def block_ids(self) -> list[int]:
        """Free block ids from head to tail (for tests and debugging)."""
        ids, node = [], self.head.next_free
        while node is not self.tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids


class BlockPool:
    """Owns every KVBlock, the free list and the hash → block map of cached blocks."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # pinned forever
        self.free_block_queue = FreeBlockQueue(self.blocks[1:])
        self.cached_blocks: dict[bytes, KVBlock] = {}
        self.events: KvEventSink | None = None
        self.on_evict: Callable[[int, bytes], None] | None = None  # (block id, its hash)
        self.on_cache: Callable[[int, bytes], None] | None = None  # a block newly cached: (id, hash)

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks in use (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        """A block handed out again loses its hash (and its cache entry), offered first to
        `on_evict` when it is the block cached under that hash."""
        if self.on_evict is not None and block.block_hash is not None \
                and self.cached_blocks.get(block.block_hash) is block:
            self.on_evict(block.block_id, block.block_hash)
        self.uncache(block)

    def uncache(self, block: KVBlock) -> None:
        """Drop `block`'s hash, and its cache entry if the entry is this block (another block
        may have been cached under the same hash first)."""
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
            block.block_hash = None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits, unlinking free ones from the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_block(self, block: KVBlock, block_hash: bytes, parent_hash: bytes = b"") -> None:
        """Register a freshly filled block under its hash (first writer wins). `parent_hash`:
        the hash of the block before it in its sequence (for the stored event)."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        if block_hash not in self.cached_blocks:
            self.cached_blocks[block_hash] = block
            if self.events is not None:
                self.events.stored(block_hash, parent_hash)
            if self.on_cache is not None:
                self.on_cache(block.block_id, block_hash)

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference per block; blocks reaching 0 rejoin the free list.

        Callers pass a request's blocks in reverse order so the tail of a sequence
        (least likely to be shared) is evicted before its head.
        """
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> None:
        """Forget every block hash. Only when no request holds a block: after a worker
        failure or restart no block's KV can be trusted (a failed step may have left it half
        written; a restarted worker has fresh, empty KV tensors)."""
        if self.num_free_blocks != self.num_blocks - 1:
            raise RuntimeError(f"reset_prefix_cache with {self.num_blocks - 1 - self.num_free_blocks} blocks in use")
        for block in self.blocks[1:]:
            block.block_hash = None
        self.cached_blocks.clear()
        if self.events is not None:
            self.events.cleared()
