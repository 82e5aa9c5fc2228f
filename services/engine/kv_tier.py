"""The KV tier's scheduler side (--kv-offloading-size): a second, larger store of KV blocks behind
the pool, keyed by the prefix cache's chained block hashes, in the KV connector's shape (the
scheduler's hooks in sched_kv_transfer.py drive it as they drive a P/D consumer).

- Stores: a block the pool caches (BlockPool.on_cache: a step fills it) is named in that step's
  metadata; the worker copies its KV out after the forward and writes it to the tier off the step
  (write-through: a prefix outlives the worker, not only the pool's eviction).
- Offers: a cached block the pool evicts to reuse (BlockPool.on_evict) that the tier does not hold
  (its store was dropped, or not reported yet) is offered: its worker copies its KV out before
  the step's forward writes new KV into it.
- Hits: a waiting request's blocks past its pool hits whose hashes the tier holds (never the block
  of the prompt's last token: it is computed to sample) are allocated and loaded there instead of
  computed; the request waits for the load (WAITING_FOR_REMOTE_KVS), then runs with those tokens
  computed. A load that fails (a file gone or corrupt) makes it compute them, once.
- The view: which hashes the tier holds is the worker's to say (it owns the files, their LRU and
  their checks); this side follows its reports (kv_tier_stored / kv_tier_removed), so a hit is a
  guess the worker's load confirms or refuses.
"""

from __future__ import annotations

from typing import Protocol

from services.common.proto import myvllm_pb2 as pb
from services.engine.kv_cache_manager import extend_block_hashes
from services.engine.request import Request


class TierEventSink(Protocol):
    """Where the tier's changes go as KV events (services/scheduler/kv_events.py's log)."""

    def tier_stored(self, block_hash: bytes, medium: str) -> None: ...

    def tier_removed(self, block_hash: bytes) -> None: ...


class KVTierScheduler:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # Where the view's changes go as KV events (services/scheduler/kv_events.py), and the medium
        # they name (config.kv_tier_medium: the engine core sets both).
        self.events: TierEventSink | None = None
        self.medium = "DISK"
        self.blocks: set[bytes] = set()      # hashes the tier holds, as its worker last reported
        self.loading: dict[str, int] = {}    # request id -> tokens its load brings, until reported
        self.saving: set[str] = set()        # (no request's save: the tier keeps blocks, not requests)
        self._loads: list[pb.KVLoad] = []
        self._offer_ids: list[int] = []
        self._offer_hashes: list[bytes] = []
        self._store_ids: list[int] = []
        self._store_hashes: list[bytes] = []
        self._failed: set[str] = set()       # requests whose tier load failed: they compute, never ask again
        # What happened, for stats (/metrics) and tests.
        self.num_queries = 0        # prompt tokens past pool hits looked up in the tier
        self.num_hits = 0           # of those, tokens loaded from the tier
        self.num_loads = 0
        self.num_load_failures = 0
        self.num_offered = 0
        self.num_stored = 0
        self.num_offers_dropped = 0
        self.loaded_bytes = 0
        self.load_seconds = 0.0

    # ------------------------------------------------------------------ offers

    def offer(self, block_id: int, block_hash: bytes) -> None:
        """The pool evicts cached block `block_id` (BlockPool.on_evict): keep its KV in the tier,
        unless the tier has it already."""
        if block_hash not in self.blocks:
            self._offer_ids.append(block_id)
            self._offer_hashes.append(block_hash)
            self.num_offered += 1

    def store(self, block_id: int, block_hash: bytes) -> None:
        """The pool caches `block_id` (BlockPool.on_cache): this step fills it; keep its KV in the
        tier too, unless the tier has it already."""
        if block_hash not in self.blocks:
            self._store_ids.append(block_id)
            self._store_hashes.append(block_hash)

    # ------------------------------------------------------------------ hits and loads

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens past `num_computed_tokens` (the pool's hits, whole blocks) whose blocks the tier
        holds, in a run from there, short of the block of the last token."""
        if request.request_id in self._failed or num_computed_tokens >= request.num_tokens:
            return 0
        bs = self.block_size
        extend_block_hashes(request, bs)
        first = num_computed_tokens // bs
        end = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        k = first
        while k < end and request.block_hashes[k] in self.blocks:
            k += 1
        if k == first:
            self.num_queries += request.num_tokens - num_computed_tokens  # (a hit: counted at its allocation)
        return (k - first) * bs

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        """The request's blocks are allocated: load its tier blocks into them."""
        bs = self.block_size
        first, count = num_computed_tokens // bs, num_external_tokens // bs
        self._loads.append(pb.KVLoad(request_id=request.request_id, first_block=first,
                                     block_ids=block_ids[first:first + count],
                                     block_hashes=request.block_hashes[first:first + count]))
        self.loading[request.request_id] = num_external_tokens
        self.num_queries += request.num_tokens - num_computed_tokens

    def load_finished(self, request_id: str, ok: bool) -> int | None:
        """The worker's report on a load: the tokens it brought (0 if it failed); None if no load of
        that request was in flight."""
        num_tokens = self.loading.pop(request_id, None)
        if num_tokens is None:
            return None
        if not ok:
            self.num_load_failures += 1
            self._failed.add(request_id)
            return 0
        self.num_loads += 1
        self.num_hits += num_tokens
        return num_tokens

    # ------------------------------------------------------------------ the connector's other hooks

    def request_finished(self, request: Request, aborted: bool) -> tuple[bool, None]:
        self._failed.discard(request.request_id)
        return False, None

    def request_saves(self, request: Request, num_new: int, block_ids: list[int]) -> None:
        """(The tier saves evicted blocks, not requests.)"""

    def save_finished(self, request_id: str) -> bool:
        return False

    def discard_later(self, handle: str) -> None:
        """(No segments.)"""

    def observe(self, runner_output: pb.ModelRunnerOutput) -> None:
        """Follow the worker's reports of what the tier holds; count its loads' bytes and seconds."""
        self.blocks.update(runner_output.kv_tier_stored)
        self.blocks.difference_update(runner_output.kv_tier_removed)
        if self.events is not None:
            for block_hash in runner_output.kv_tier_stored:
                self.events.tier_stored(block_hash, self.medium)
            for block_hash in runner_output.kv_tier_removed:
                self.events.tier_removed(block_hash)
        self.num_stored += len(runner_output.kv_tier_stored)
        self.num_offers_dropped += runner_output.kv_tier_offers_dropped
        self.loaded_bytes += runner_output.kv_loaded_bytes
        self.load_seconds += runner_output.kv_load_seconds

    def stats(self) -> dict[str, float | str]:
        """Stats fields (proto Stats.kv_tier_*)."""
        return {"kv_tier_queries": self.num_queries, "kv_tier_hits": self.num_hits, "kv_tier_loads": self.num_loads,
                "kv_tier_load_failures": self.num_load_failures, "kv_tier_blocks": len(self.blocks),
                "kv_tier_offered_blocks": self.num_offered, "kv_tier_stored_blocks": self.num_stored,
                "kv_tier_offers_dropped": self.num_offers_dropped, "kv_tier_loaded_bytes": self.loaded_bytes,
                "kv_tier_load_seconds": self.load_seconds}

    # ------------------------------------------------------------------ every step

    @property
    def has_pending(self) -> bool:
        """Loads in flight or to send, stores and offers to send: the worker must see steps until then."""
        return bool(self.loading or self._loads or self._offer_ids or self._store_ids)

    def build_connector_meta(self) -> pb.KVConnectorMetadata | None:
        """This step's metadata (None when nothing is pending: while loads are in flight an empty
        one, so that a step lets the worker report them when nothing else runs)."""
        if not self.has_pending:
            return None
        meta = pb.KVConnectorMetadata(loads=self._loads, offload_block_ids=self._offer_ids,
                                      offload_block_hashes=self._offer_hashes, store_block_ids=self._store_ids,
                                      store_block_hashes=self._store_hashes)
        self._loads, self._offer_ids, self._offer_hashes = [], [], []
        self._store_ids, self._store_hashes = [], []
        return meta

    def reset(self) -> None:
        """The worker is gone, and its loads with it (the tier's files stay: the view stays too, and
        a restarted worker reports what it finds)."""
        self._loads, self._offer_ids, self._offer_hashes = [], [], []
        self._store_ids, self._store_hashes = [], []
        self.loading.clear()
