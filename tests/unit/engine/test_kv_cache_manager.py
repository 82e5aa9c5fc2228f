"""KVCacheManager: chained block hashes, prefix-cache lookups, allocation and freeing."""

from __future__ import annotations

import random

import pytest
from support.schedulers import scheduler_for

from services.common.proto import myvllm_pb2 as pb
from services.engine.kv_cache_manager import NONE_HASH, KVCacheManager, extend_block_hashes, hash_block_tokens
from services.engine.request import Request

B = 4  # block size


def _req(rid: str, tokens: list[int], cache_salt: str = "", max_tokens: int = 8) -> Request:
    return Request(rid, list(tokens), pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=-1),
                   frozenset({2}), max_tokens=max_tokens, cache_salt=cache_salt)


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def _compute(mgr: KVCacheManager, req: Request, num_new: int, hits=None) -> list:
    """What the scheduler does around one step: allocate, count as computed, cache full blocks."""
    hits = hits or []
    new = mgr.allocate_slots(req, num_new, hits)
    assert new is not None
    req.num_computed_tokens += len(hits) * mgr.block_size + num_new
    mgr.cache_full_blocks(req, req.num_computed_tokens)
    return new


def _snapshot(mgr: KVCacheManager):
    pool = mgr.block_pool
    return (pool.free_block_queue.block_ids(), [b.ref_cnt for b in pool.blocks],
            [b.block_hash for b in pool.blocks], dict(pool.cached_blocks),
            {k: list(v) for k, v in mgr.req_to_blocks.items()}, dict(mgr.num_cached_blocks))


# --------------------------------------------------------------------------- hashes


def test_hash_chain() -> None:
    toks = _tokens(3 * B)
    req = _req("a", toks)
    extend_block_hashes(req, B)
    assert len(req.block_hashes) == 3
    h0 = hash_block_tokens(NONE_HASH, toks[:B])
    h1 = hash_block_tokens(h0, toks[B:2 * B])
    h2 = hash_block_tokens(h1, toks[2 * B:])
    assert req.block_hashes == [h0, h1, h2]
    assert len(set(req.block_hashes)) == 3


def test_same_block_tokens_different_prefix_different_hash() -> None:
    shared = _tokens(B, seed=1)
    a = _req("a", _tokens(B, seed=2) + shared)
    b = _req("b", _tokens(B, seed=3) + shared)
    extend_block_hashes(a, B)
    extend_block_hashes(b, B)
    assert a.block_hashes[0] != b.block_hashes[0]
    assert a.block_hashes[1] != b.block_hashes[1]  # same tokens, different parent
    # Same prefix, same block → same hash.
    c = _req("c", a.all_token_ids + _tokens(3, seed=4))
    extend_block_hashes(c, B)
    assert c.block_hashes == a.block_hashes


def test_hash_depends_on_every_token_and_its_order() -> None:
    toks = _tokens(B)
    base = hash_block_tokens(NONE_HASH, toks)
    for i in range(B):
        changed = list(toks)
        changed[i] += 1
        assert hash_block_tokens(NONE_HASH, changed) != base
    assert hash_block_tokens(NONE_HASH, toks[::-1]) != base
    assert hash_block_tokens(NONE_HASH, toks) == base  # deterministic


def test_cache_salt_changes_every_hash() -> None:
    toks = _tokens(3 * B)
    plain, salted, salted2, salted_again = (_req("p", toks), _req("s", toks, "alice"), _req("t", toks, "bob"),
                                            _req("u", toks, "alice"))
    for r in (plain, salted, salted2, salted_again):
        extend_block_hashes(r, B)
    for k in range(3):
        assert plain.block_hashes[k] != salted.block_hashes[k]
        assert salted.block_hashes[k] != salted2.block_hashes[k]
    assert salted.block_hashes == salted_again.block_hashes


def test_cache_salt_isolates_prefix_cache() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=B)
    toks = _tokens(3 * B + 1)
    a = _req("a", toks, "alice")
    _compute(mgr, a, a.num_tokens)
    assert mgr.get_computed_blocks(_req("b", toks, "bob"))[1] == 0
    assert mgr.get_computed_blocks(_req("c", toks))[1] == 0
    assert mgr.get_computed_blocks(_req("d", toks, "alice"))[1] == 3 * B


def test_only_full_blocks_hashed() -> None:
    req = _req("a", _tokens(2 * B + 3))
    extend_block_hashes(req, B)
    assert len(req.block_hashes) == 2
    first = list(req.block_hashes)
    req.append_output_token(5)
    extend_block_hashes(req, B)
    assert len(req.block_hashes) == 3
    assert req.block_hashes[:2] == first  # earlier hashes are not recomputed differently
    assert req.block_hashes[2] == hash_block_tokens(first[1], req.all_token_ids[2 * B:3 * B])
    req.append_output_token(6)
    extend_block_hashes(req, B)
    assert len(req.block_hashes) == 3


def test_partial_block_never_cached() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=B)
    req = _req("a", _tokens(2 * B + 2))
    blocks = _compute(mgr, req, req.num_tokens)
    assert len(blocks) == 3
    assert blocks[0].block_hash is not None and blocks[1].block_hash is not None
    assert blocks[2].block_hash is None
    assert len(mgr.block_pool.cached_blocks) == 2


def test_full_blocks_cached_at_allocation() -> None:
    """Full blocks whose tokens are known are registered when allocated (their KV is written in
    the same step, before any attention reads), so a request scheduled later in that step hits."""
    mgr = KVCacheManager(num_blocks=16, block_size=B)
    toks = _tokens(3 * B + 1)
    req = _req("a", toks)
    assert mgr.allocate_slots(req, 2 * B + 2) is not None
    assert len(mgr.block_pool.cached_blocks) == 2          # the chunk's 2 full blocks, not the partial one
    assert mgr.num_cached_blocks["a"] == 2
    twin = _req("b", toks)
    hits, n = mgr.get_computed_blocks(twin)
    assert n == 2 * B and hits == mgr.req_to_blocks["a"][:2]
    req.num_computed_tokens = 2 * B + 2
    assert mgr.allocate_slots(req, 1) is not None           # still inside block 2
    assert len(mgr.block_pool.cached_blocks) == 2
    req.num_computed_tokens += 1
    assert mgr.allocate_slots(req, 2) is not None           # completes block 2 (1 token overflows)
    assert len(mgr.block_pool.cached_blocks) == 3
    assert mgr.num_cached_blocks["a"] == 3


def test_only_known_tokens_are_cached() -> None:
    """Room allocated past the known tokens (e.g. for a token still to be sampled) is not hashed."""
    mgr = KVCacheManager(num_blocks=16, block_size=B)
    req = _req("a", _tokens(2 * B - 1))
    assert mgr.allocate_slots(req, 2 * B) is not None       # 1 slot more than the known tokens
    assert len(mgr.req_to_blocks["a"]) == 2
    assert len(mgr.block_pool.cached_blocks) == 1


def test_uncache_blocks_from() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=B)
    toks = _tokens(4 * B + 1)
    req = _req("a", toks)
    mgr.allocate_slots(req, req.num_tokens)
    blocks = list(mgr.req_to_blocks["a"])
    assert all(b.block_hash is not None for b in blocks[:4])
    mgr.uncache_blocks_from(req, 2)
    assert [b.block_hash is not None for b in blocks] == [True, True, False, False, False]
    assert set(mgr.block_pool.cached_blocks.values()) == set(blocks[:2])
    assert mgr.num_cached_blocks["a"] == 2
    assert mgr.get_computed_blocks(_req("b", toks))[1] == 2 * B
    # Freed, the uncached blocks go to the head (reused first), the cached ones to the tail.
    mgr.free(req)
    q = mgr.block_pool.free_block_queue.block_ids()
    assert q[:3] == [blocks[2].block_id, blocks[3].block_id, blocks[4].block_id]
    assert q[-2:] == [blocks[1].block_id, blocks[0].block_id]


def test_generated_tokens_fill_cacheable_blocks() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=B)
    prompt = _tokens(B + 2)
    req = _req("a", prompt)
    _compute(mgr, req, req.num_tokens)
    for tok in (7, 8, 9):
        req.append_output_token(tok)
        _compute(mgr, req, 1)
    # prompt (6) + 2 outputs fill block 1; the 3rd output is not yet computed (num_computed == 8).
    assert len(mgr.block_pool.cached_blocks) == 2
    follow = _req("b", prompt + [7, 8, 9, 10])
    blocks, n = mgr.get_computed_blocks(follow)
    assert n == 2 * B
    assert [b.block_id for b in blocks] == mgr.block_ids("a")[:2]


# --------------------------------------------------------------------------- lookups


def test_lookup_hits_whole_cached_prefix() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=B)
    toks = _tokens(3 * B + 2)
    a = _req("a", toks)
    _compute(mgr, a, a.num_tokens)
    b = _req("b", toks[:3 * B] + _tokens(5, seed=9))
    blocks, n = mgr.get_computed_blocks(b)
    assert n == 3 * B
    assert [blk.block_id for blk in blocks] == mgr.block_ids("a")[:3]
    # get_computed_blocks does not take references.
    assert all(blk.ref_cnt == 1 for blk in blocks)


def test_lookup_stops_at_first_miss() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=B)
    toks = _tokens(4 * B + 1)
    a = _req("a", toks)
    _compute(mgr, a, a.num_tokens)
    a_blocks = list(mgr.req_to_blocks["a"])
    assert all(blk.block_hash is not None for blk in a_blocks[:4])
    # Evict block 1's cache entry while blocks 0, 2, 3 stay cached.
    mgr.block_pool._evict(a_blocks[1])
    assert mgr.block_pool.get_cached_block(a.block_hashes[2]) is a_blocks[2]
    blocks, n = mgr.get_computed_blocks(_req("b", toks))
    assert n == B
    assert blocks == [a_blocks[0]]


def test_lookup_diverging_block_misses_rest() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=B)
    toks = _tokens(4 * B + 1)
    _compute(mgr, _req("a", toks), len(toks))
    other = list(toks)
    other[B + 1] += 1  # block 1 differs; blocks 2, 3 have equal tokens but a different chain
    blocks, n = mgr.get_computed_blocks(_req("b", other))
    assert n == B and len(blocks) == 1


@pytest.mark.parametrize("prompt_len,expected_hit_blocks", [
    (2 * B, 1),      # exactly 2 full blocks, both cached: only 1 may hit (the last token must run)
    (2 * B + 1, 2),  # one token past the blocks: both hit
    (1, 0),
    (B, 0),
    (B + 1, 1),
])
def test_at_most_num_tokens_minus_one_hit(prompt_len: int, expected_hit_blocks: int) -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=B)
    long = _tokens(3 * B)
    _compute(mgr, _req("a", long), len(long))
    assert len(mgr.block_pool.cached_blocks) == 3
    blocks, n = mgr.get_computed_blocks(_req("b", long[:prompt_len]))
    assert n == expected_hit_blocks * B
    assert len(blocks) == expected_hit_blocks
    assert n <= prompt_len - 1


def test_lookup_disabled() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=B, enable_prefix_caching=False)
    toks = _tokens(3 * B + 1)
    _compute(mgr, _req("a", toks), len(toks))
    assert mgr.block_pool.cached_blocks == {}
    assert mgr.get_computed_blocks(_req("b", toks)) == ([], 0)


def test_hit_on_free_cached_blocks_touches_them() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=B)
    toks = _tokens(2 * B + 1)
    a = _req("a", toks)
    _compute(mgr, a, a.num_tokens)
    a_ids = mgr.block_ids("a")
    mgr.free(a)
    assert mgr.block_pool.num_free_blocks == 7
    b = _req("b", toks)
    hits, n = mgr.get_computed_blocks(b)
    assert n == 2 * B
    # As the scheduler does: num_computed_tokens still 0, the hits passed alongside.
    new = mgr.allocate_slots(b, b.num_tokens - n, hits)
    assert [blk.block_id for blk in new] == [a_ids[2]]  # the unhashed block went back to the head
    assert mgr.block_ids("b") == a_ids
    assert all(blk.ref_cnt == 1 for blk in hits)
    assert mgr.block_pool.num_free_blocks == 4
    assert not set(a_ids) & set(mgr.block_pool.free_block_queue.block_ids())


def test_shared_hits_ref_count() -> None:
    mgr = KVCacheManager(num_blocks=12, block_size=B)
    toks = _tokens(2 * B + 1)
    a = _req("a", toks)
    _compute(mgr, a, a.num_tokens)
    b = _req("b", toks)
    hits, n = mgr.get_computed_blocks(b)
    mgr.allocate_slots(b, 1, hits)
    assert [blk.ref_cnt for blk in hits] == [2, 2]
    mgr.free(a)
    assert [blk.ref_cnt for blk in hits] == [1, 1]
    assert not {blk.block_id for blk in hits} & set(mgr.block_pool.free_block_queue.block_ids())
    mgr.free(b)
    assert [blk.ref_cnt for blk in hits] == [0, 0]
    assert mgr.block_pool.num_free_blocks == 11


# --------------------------------------------------------------------------- allocation


def test_allocate_slots_block_arithmetic() -> None:
    mgr = KVCacheManager(num_blocks=16, block_size=B)
    req = _req("a", _tokens(10))
    assert len(mgr.allocate_slots(req, 5)) == 2     # tokens 0..4 → 2 blocks
    req.num_computed_tokens = 5
    assert len(mgr.allocate_slots(req, 3)) == 0     # tokens 5..7 still fit in block 1
    req.num_computed_tokens = 8
    assert len(mgr.allocate_slots(req, 2)) == 1     # tokens 8..9 → block 2
    req.num_computed_tokens = 10
    assert len(mgr.allocate_slots(req, 7)) == 2     # tokens 10..16 → blocks 2 (partly), 3, 4
    assert len(mgr.block_ids("a")) == 5


def test_allocate_slots_short_pool_returns_none_and_changes_nothing() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=B)  # 5 usable
    a = _req("a", _tokens(3 * B))
    _compute(mgr, a, a.num_tokens)                     # a holds 3 blocks (cached)
    before = _snapshot(mgr)
    b = _req("b", _tokens(3 * B, seed=5))
    assert mgr.allocate_slots(b, 3 * B) is None        # needs 3, 2 free
    assert _snapshot(mgr) == before
    assert "b" not in mgr.req_to_blocks
    # A request that already holds blocks keeps exactly them.
    assert mgr.allocate_slots(a, 3 * B) is None
    assert _snapshot(mgr) == before
    # Exactly enough works.
    assert len(mgr.allocate_slots(b, 2 * B)) == 2
    assert mgr.block_pool.num_free_blocks == 0


def test_allocate_slots_counts_free_hits_against_the_pool() -> None:
    mgr = KVCacheManager(num_blocks=5, block_size=B)  # 4 usable
    toks = _tokens(2 * B + 1)
    a = _req("a", toks)
    _compute(mgr, a, a.num_tokens)
    mgr.free(a)                                       # 2 cached + 1 plain block back in the free list
    b = _req("b", toks + _tokens(3 * B, seed=6))      # 2 hits, then 3*B + 1 more tokens
    hits, n = mgr.get_computed_blocks(b)
    assert n == 2 * B
    before = _snapshot(mgr)
    # 4 free blocks, 2 of them are the hits themselves: only 2 left for 4 new blocks.
    assert mgr.allocate_slots(b, b.num_tokens - n, hits) is None
    assert _snapshot(mgr) == before
    assert all(blk.ref_cnt == 0 for blk in hits)
    # With 2 new blocks it fits exactly.
    assert len(mgr.allocate_slots(b, 2 * B, hits)) == 2
    assert mgr.block_pool.num_free_blocks == 0
    assert [blk.ref_cnt for blk in hits] == [1, 1]


def test_eviction_order_when_pool_reused() -> None:
    mgr = KVCacheManager(num_blocks=7, block_size=B)  # 6 usable
    ta, tb = _tokens(3 * B, seed=1), _tokens(3 * B, seed=2)
    a, b = _req("a", ta), _req("b", tb)
    _compute(mgr, a, a.num_tokens)
    _compute(mgr, b, b.num_tokens)
    a_ids, b_ids = mgr.block_ids("a"), mgr.block_ids("b")
    mgr.free(a)  # freed first → evicted first, each request tail block first
    mgr.free(b)
    assert mgr.block_pool.free_block_queue.block_ids() == a_ids[::-1] + b_ids[::-1]
    # A new 1-block request evicts a's last block; a's first two blocks still hit.
    c = _req("c", _tokens(B - 1, seed=3))
    _compute(mgr, c, c.num_tokens)
    assert mgr.block_ids("c") == [a_ids[2]]
    assert mgr.get_computed_blocks(_req("a2", ta + [1]))[1] == 2 * B
    assert mgr.get_computed_blocks(_req("b2", tb + [1]))[1] == 3 * B
    # Two more: a's remaining blocks go (block 1 before block 0), b stays whole.
    d = _req("d", _tokens(2 * B - 1, seed=4))
    _compute(mgr, d, d.num_tokens)
    assert mgr.block_ids("d") == [a_ids[1], a_ids[0]]
    assert mgr.get_computed_blocks(_req("a3", ta + [1]))[1] == 0
    assert mgr.get_computed_blocks(_req("b3", tb + [1]))[1] == 3 * B


def test_free_returns_every_block() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=B)
    reqs = [_req(str(i), _tokens(n, seed=i)) for i, n in enumerate([1, B, 2 * B + 3, 5 * B])]
    for r in reqs:
        _compute(mgr, r, r.num_tokens)
    assert mgr.block_pool.num_free_blocks == 19 - (1 + 1 + 3 + 5)
    for r in reqs:
        mgr.free(r)
    assert mgr.block_pool.num_free_blocks == 19
    assert sorted(mgr.block_pool.free_block_queue.block_ids()) == list(range(1, 20))
    assert all(b.ref_cnt == 0 for b in mgr.block_pool.blocks[1:])
    assert mgr.req_to_blocks == {} and mgr.num_cached_blocks == {}
    # Freeing an unknown / already freed request is harmless.
    mgr.free(reqs[0])
    assert mgr.block_pool.num_free_blocks == 19


def test_free_puts_request_tail_first() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=B)
    r = _req("a", _tokens(3 * B + 2))
    _compute(mgr, r, r.num_tokens)
    ids = mgr.block_ids("a")
    mgr.free(r)
    q = mgr.block_pool.free_block_queue.block_ids()
    assert q[0] == ids[3]               # the partial block is reused first
    assert q[-3:] == ids[2::-1]         # cached blocks: tail block evicted before the head


# --------------------------------------------------------------------------- counters


def test_record_prefix_lookup_counters() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=B)
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (0, 0)
    mgr.record_prefix_lookup(10, 4)
    mgr.record_prefix_lookup(7, 0)
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (17, 4)


def test_usage() -> None:
    mgr = KVCacheManager(num_blocks=5, block_size=B)
    r = _req("a", _tokens(2 * B))
    _compute(mgr, r, r.num_tokens)
    assert mgr.usage == pytest.approx(0.5)
    mgr.free(r)
    assert mgr.usage == 0.0


def test_scheduler_counts_lookups_once_per_schedule() -> None:
    """A waiting request retried over several steps is counted when it is scheduled, once."""
    sched = scheduler_for(num_blocks=8, block_size=B, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    toks = _tokens(3 * B + 1)
    sched.add_request(_req("a", toks, max_tokens=4))
    so = sched.schedule()
    sched.update_from_output(so, pb.ModelRunnerOutput(request_ids=["a"], sampled_token_ids=[5]))
    stats = sched.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (3 * B + 1, 0)
    # b shares a's 3 full blocks and needs 4 more, but the pool (7 blocks, a holds 4) has 3.
    sched.add_request(_req("b", toks + _tokens(3 * B, seed=8), max_tokens=2))
    for _ in range(2):
        so = sched.schedule()
        assert [r.request_id for r in so.new_requests] == []
        sched.update_from_output(so, pb.ModelRunnerOutput(request_ids=["a"], sampled_token_ids=[5]))
    stats = sched.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (3 * B + 1, 0)
    sched.abort_requests(["a"])
    so = sched.schedule()
    assert [r.request_id for r in so.new_requests] == ["b"]
    stats = sched.stats()
    assert stats["prefix_cache_queries"] == 3 * B + 1 + 6 * B + 1
    assert stats["prefix_cache_hits"] == 3 * B
    assert so.new_requests[0].num_computed_tokens == 3 * B
