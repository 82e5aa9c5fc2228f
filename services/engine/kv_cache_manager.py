"""Per-request KV block bookkeeping on top of the BlockPool, with prefix caching.

Block hashes chain: hash(block k) = H(hash(block k-1), token ids of block k, extra keys),
so equal hashes mean equal whole prefixes. Only full blocks are hashed. The hash lives in
services/common/block_hash.py, shared with the gateway.
"""

from __future__ import annotations

from services.common.block_hash import NONE_HASH, adapter_key, extend_hashes, hash_block_tokens
from services.engine.block_pool import BlockPool, KVBlock
from services.engine.request import Request

__all__ = ["NONE_HASH", "KVCacheManager", "extend_block_hashes", "hash_block_tokens"]


def extend_block_hashes(request: Request, block_size: int) -> None:
    """Hash every full block of `request` not hashed yet (services/common/block_hash.py: the
    gateway computes the same hashes to route by cached prefix)."""
    lora = request.lora_request
    extend_hashes(request.block_hashes, request.all_token_ids, block_size, request.cache_salt,
                  adapter_key(lora.lora_name, lora.lora_int_id) if lora is not None else None)


class KVCacheManager:
    """Which blocks each request holds, and the prefix-cache lookups feeding them."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # How many of each request's blocks are already registered in the cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0     # tokens found

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of `request`, in whole blocks, never its last token.

        The last token must be computed to produce logits, so at most num_tokens - 1
        tokens can hit. Returns the blocks (not yet touched) and the number of tokens.
        """
        if not self.enable_prefix_caching:
            return [], 0
        extend_block_hashes(request, self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup once, when its request is actually scheduled (not on every retry)."""
        self.prefix_cache_queries += num_queried_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
        delay_cache_blocks: bool = False,
    ) -> list[KVBlock] | None:
        """Give `request` room for `num_new_tokens` more tokens after its computed ones.

        `new_computed_blocks` are prefix-cache hits found this step (touched here).
        Returns the newly allocated blocks, or None (and changes nothing) if the pool
        cannot supply them. `delay_cache_blocks`: their KV comes from elsewhere (a remote load):
        the caller caches them (`cache_full_blocks`) once it is there.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_needed_blocks = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = num_needed_blocks - len(blocks) - len(new_computed_blocks)
        # Hits that sit in the free list are taken out of it by touch().
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_evictable_hits:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        blocks.extend(new_blocks)
        self.num_cached_blocks.setdefault(request.request_id, len(new_computed_blocks))
        # Full blocks whose tokens are known are cached now, before their KV is written, so
        # requests scheduled later in this same step (n > 1 siblings, shared prefixes) hit
        # them: the worker stores every token's K/V of a step before any attention reads.
        if not delay_cache_blocks:
            self.cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def uncache_blocks_from(self, request: Request, first_block: int) -> None:
        """Forget the hashes of `request`'s blocks from `first_block` on (their KV will never
        be written: the request was unscheduled after allocate_slots cached them)."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        for block in blocks[first_block:]:
            self.block_pool.uncache(block)
        if self.num_cached_blocks.get(request.request_id, 0) > first_block:
            self.num_cached_blocks[request.request_id] = first_block

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        blocks = self.req_to_blocks[request.request_id]
        num_full = min(num_tokens // self.block_size, len(blocks))
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        extend_block_hashes(request, self.block_size)
        for k in range(start, num_full):
            parent = request.block_hashes[k - 1] if k > 0 else NONE_HASH
            self.block_pool.cache_full_block(blocks[k], request.block_hashes[k], parent)
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Return all of `request`'s blocks, tail first so its prefix stays cached longest."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]
