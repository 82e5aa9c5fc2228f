"""BlockPool / FreeBlockQueue: the exact free-list algorithm (docs/design.md, "Block pool")."""

from __future__ import annotations

import pytest

from services.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock


def _hash(i: int) -> bytes:
    return i.to_bytes(32, "little")


def _forward_ids(q: FreeBlockQueue) -> list[int]:
    return q.block_ids()


def _backward_ids(q: FreeBlockQueue) -> list[int]:
    """Walk tail → head through prev_free: the back links must mirror the forward ones."""
    ids, node = [], q.tail.prev_free
    while node is not q.head:
        ids.append(node.block_id)
        node = node.prev_free
    return ids[::-1]


def _check_links(q: FreeBlockQueue, expected: list[int]) -> None:
    assert _forward_ids(q) == expected
    assert _backward_ids(q) == expected
    assert q.num_free_blocks == len(expected)


# --------------------------------------------------------------------------- FreeBlockQueue


def test_queue_initial_order_and_sentinels() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    _check_links(q, [0, 1, 2, 3, 4])
    assert q.head.next_free is blocks[0]
    assert q.tail.prev_free is blocks[4]
    assert blocks[0].prev_free is q.head
    assert blocks[4].next_free is q.tail


def test_queue_empty() -> None:
    q = FreeBlockQueue([])
    _check_links(q, [])
    assert q.head.next_free is q.tail and q.tail.prev_free is q.head
    with pytest.raises(RuntimeError):
        q.popleft()


def test_queue_remove_from_middle_is_a_local_unlink() -> None:
    blocks = [KVBlock(i) for i in range(6)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[3])
    _check_links(q, [0, 1, 2, 4, 5])
    # O(1): only the neighbours' pointers change, the removed block is fully detached.
    assert blocks[2].next_free is blocks[4]
    assert blocks[4].prev_free is blocks[2]
    assert blocks[3].prev_free is None and blocks[3].next_free is None
    # First and last element too.
    q.remove(blocks[0])
    q.remove(blocks[5])
    _check_links(q, [1, 2, 4])
    assert q.head.next_free is blocks[1]
    assert q.tail.prev_free is blocks[4]


def test_queue_remove_twice_raises() -> None:
    blocks = [KVBlock(i) for i in range(3)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[1])
    with pytest.raises(RuntimeError):
        q.remove(blocks[1])
    _check_links(q, [0, 2])


def test_queue_popleft_order_and_append_appendleft() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks[:3])
    assert q.popleft() is blocks[0]
    assert q.popleft() is blocks[1]
    _check_links(q, [2])
    q.append(blocks[3])       # tail
    q.appendleft(blocks[4])   # head
    _check_links(q, [4, 2, 3])
    assert [q.popleft().block_id for _ in range(3)] == [4, 2, 3]
    _check_links(q, [])
    with pytest.raises(RuntimeError):
        q.popleft()


def test_queue_remove_then_reinsert() -> None:
    blocks = [KVBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.append(blocks[2])
    _check_links(q, [0, 1, 3, 2])
    q.remove(blocks[1])
    q.appendleft(blocks[1])
    _check_links(q, [1, 0, 3, 2])


# --------------------------------------------------------------------------- BlockPool


def test_pool_needs_a_null_block_and_one_more() -> None:
    with pytest.raises(ValueError):
        BlockPool(1)
    pool = BlockPool(2)
    assert pool.num_free_blocks == 1


def test_null_block_never_handed_out() -> None:
    pool = BlockPool(8)
    assert pool.null_block is pool.blocks[0]
    assert pool.num_free_blocks == 7
    assert 0 not in pool.free_block_queue.block_ids()
    got = pool.get_new_blocks(7)
    assert [b.block_id for b in got] == [1, 2, 3, 4, 5, 6, 7]
    assert pool.num_free_blocks == 0
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)
    # Freeing the null block (e.g. a padded block table) is a no-op.
    pool.free_blocks([pool.null_block])
    assert pool.num_free_blocks == 0
    assert pool.null_block.ref_cnt == 1
    pool.free_blocks(reversed(got))
    assert pool.num_free_blocks == 7
    # Cycle the whole pool several times: block 0 never shows up.
    for _ in range(3):
        again = pool.get_new_blocks(7)
        assert 0 not in [b.block_id for b in again]
        pool.free_blocks(again)


def test_get_new_blocks_too_many_changes_nothing() -> None:
    pool = BlockPool(4)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(4)
    assert pool.num_free_blocks == 3
    assert pool.free_block_queue.block_ids() == [1, 2, 3]


def test_ref_counts() -> None:
    pool = BlockPool(6)
    a, b = pool.get_new_blocks(2)
    assert (a.ref_cnt, b.ref_cnt) == (1, 1)
    pool.cache_full_block(a, _hash(1))
    pool.touch([a])  # a second request shares block a
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert a.ref_cnt == 1
    assert a.block_id not in pool.free_block_queue.block_ids()  # still in use
    assert pool.num_free_blocks == 3
    pool.free_blocks([a, b])
    assert (a.ref_cnt, b.ref_cnt) == (0, 0)
    assert pool.num_free_blocks == 5


def test_touch_unlinks_free_cached_block_from_the_middle() -> None:
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(5)
    for i, blk in enumerate(blocks):
        pool.cache_full_block(blk, _hash(i))
    pool.free_blocks(reversed(blocks))  # all hashed → tail, reversed: [5, 4, 3, 2, 1]
    assert pool.free_block_queue.block_ids() == [5, 4, 3, 2, 1]
    mid = pool.get_cached_block(_hash(2))
    assert mid is blocks[2] and mid.ref_cnt == 0
    pool.touch([mid])
    assert mid.ref_cnt == 1
    assert pool.free_block_queue.block_ids() == [5, 4, 2, 1]
    assert pool.num_free_blocks == 4
    assert mid.prev_free is None and mid.next_free is None
    # The hash survives a touch (it is a hit, not a reallocation).
    assert mid.block_hash == _hash(2) and pool.get_cached_block(_hash(2)) is mid
    # Touching a block that is in use only bumps its count.
    pool.touch([mid])
    assert mid.ref_cnt == 2 and pool.num_free_blocks == 4


def test_free_order_unhashed_to_head_hashed_to_tail() -> None:
    pool = BlockPool(10)
    # Request A holds blocks 1..4: 1, 2 full and cached; 3, 4 not hashed.
    a = pool.get_new_blocks(4)
    pool.cache_full_block(a[0], _hash(10))
    pool.cache_full_block(a[1], _hash(11))
    assert pool.free_block_queue.block_ids() == [5, 6, 7, 8, 9]
    pool.free_blocks(reversed(a))  # reverse order: 4, 3, 2, 1
    # Unhashed 4 then 3 go to the head (3 ends up first), hashed 2 then 1 to the tail.
    assert pool.free_block_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    # Reuse takes the unhashed blocks first...
    got = pool.get_new_blocks(2)
    assert [b.block_id for b in got] == [3, 4]
    # ...and the cached ones are evicted last, the request's tail block before its head.
    got += pool.get_new_blocks(5)
    assert [b.block_id for b in got[2:]] == [5, 6, 7, 8, 9]
    assert pool.get_cached_block(_hash(11)) is a[1]
    assert [b.block_id for b in pool.get_new_blocks(1)] == [2]
    assert pool.get_cached_block(_hash(11)) is None
    assert pool.get_cached_block(_hash(10)) is a[0]
    assert [b.block_id for b in pool.get_new_blocks(1)] == [1]
    assert pool.get_cached_block(_hash(10)) is None


def test_hashed_blocks_form_an_lru() -> None:
    pool = BlockPool(7)
    first = pool.get_new_blocks(3)
    second = pool.get_new_blocks(3)
    for i, blk in enumerate(first + second):
        pool.cache_full_block(blk, _hash(100 + i))
    pool.free_blocks(reversed(first))   # freed earlier → evicted earlier
    pool.free_blocks(reversed(second))
    assert pool.free_block_queue.block_ids() == [3, 2, 1, 6, 5, 4]
    # A hit on block 2 takes it out; when freed again it becomes the most recently used.
    hit = pool.get_cached_block(_hash(101))
    pool.touch([hit])
    pool.free_blocks([hit])
    assert pool.free_block_queue.block_ids() == [3, 1, 6, 5, 4, 2]


def test_reallocated_block_loses_hash_and_cache_entry() -> None:
    pool = BlockPool(3)
    blk = pool.get_new_blocks(1)[0]
    pool.cache_full_block(blk, _hash(7))
    assert blk.block_hash == _hash(7)
    pool.free_blocks([blk])
    assert pool.get_cached_block(_hash(7)) is blk  # free but still cached
    # Exhaust the pool: the unhashed block goes first, then the cached one is evicted.
    other = pool.get_new_blocks(1)[0]
    assert other is not blk
    assert pool.get_cached_block(_hash(7)) is blk
    again = pool.get_new_blocks(1)[0]
    assert again is blk
    assert blk.block_hash is None
    assert pool.get_cached_block(_hash(7)) is None
    assert _hash(7) not in pool.cached_blocks
    assert blk.ref_cnt == 1
    # Freed again without a hash it goes to the head.
    pool.free_blocks([other])
    pool.free_blocks([blk])
    assert pool.free_block_queue.block_ids() == [blk.block_id, other.block_id]


def test_cache_full_block_first_writer_wins() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, _hash(1))
    pool.cache_full_block(b, _hash(1))  # same content computed twice
    assert pool.get_cached_block(_hash(1)) is a
    # A block already cached keeps its first hash.
    pool.cache_full_block(a, _hash(2))
    assert a.block_hash == _hash(1)
    assert pool.get_cached_block(_hash(2)) is None
    # Evicting the duplicate b must not drop a's entry.
    pool.free_blocks([b])
    pool.free_blocks([a])
    pool.get_new_blocks(1)  # the unused third block (head)
    evicted = pool.get_new_blocks(1)[0]
    assert evicted is b
    assert pool.get_cached_block(_hash(1)) is a


def test_prefix_caching_disabled_never_caches() -> None:
    pool = BlockPool(4, enable_prefix_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, _hash(3))
    assert a.block_hash is None
    assert pool.get_cached_block(_hash(3)) is None
    pool.free_blocks([a])
    assert pool.free_block_queue.block_ids()[0] == a.block_id


def test_usage() -> None:
    pool = BlockPool(5)
    assert pool.usage == 0.0
    got = pool.get_new_blocks(2)
    assert pool.usage == pytest.approx(0.5)
    pool.cache_full_block(got[0], _hash(1))
    pool.free_blocks(got)
    assert pool.usage == 0.0  # cached-but-free counts as free
