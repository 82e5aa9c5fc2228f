"""Data-parallel routing: which engine replica (scheduler) gets the next request.

Replicas come from two places: the `--scheduler` addresses given on the command line, and,
with `--redis`, every replica whose scheduler publishes its load to Redis (hash
`myvllm:engines`, written by `services/scheduler/load_reporter.py`). A replica whose
entry goes stale (its scheduler stopped publishing) is polled directly for a few seconds,
then dropped from routing. While Redis itself is unreachable, routing goes on with the
replicas last seen there, polled directly. With an internal token, only entries whose MAC
checks out count (services/common/redis_registry.py): any other entry is never dialled, so
the token never reaches it, and is logged once.

Which healthy replica a request goes to is the routing policy's choice (`--routing`,
services/gateway/routing.py): by load, vLLM's DP load-balancing score `4 * waiting +
running`, using the last published load plus the requests this gateway sent there since (so
a burst arriving between two load updates spreads out instead of piling onto one replica);
round-robin; or cache-aware (the default), which also weighs how much of the prompt each
replica has in its prefix cache, as known from that replica's KV event stream
(services/gateway/kv_subscriber.py, one subscription per replica), against its queue, in
seconds from the step time and prefill rate it publishes with its load. Replicas given on the
command line without Redis are polled with `GetLoad` instead. A replica that fails is marked
down and skipped until it answers again; the request that found it down is retried on another
replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from services.client.grpc_client import AsyncClient, SchedulerUnavailable
from services.common import redis_registry
from services.common.proto import myvllm_pb2 as pb
from services.gateway.dp_waves import GroupWaves
from services.gateway.kv_subscriber import follow_kv_events
from services.gateway.prefix_index import PrefixIndex
from services.gateway.routing import (
    WAITING_WEIGHT,
    Candidate,
    RoutePrompt,
    RoutingConfig,
    RoutingPolicy,
    choose_cache_aware,
)

logger = logging.getLogger(__name__)

REFRESH_INTERVAL_S = 0.25
REDIS_MAX_AGE_S = 5.0        # schedulers refresh their entry about once a second
MAX_REJECTED_LOGGED = 1024   # refused Redis entries logged by (engine id, address), once each
# Prefill/decode disaggregation: which replicas take which half of a request.
PRODUCER_ROLES = ("kv_producer", "kv_both")
CONSUMER_ROLES = ("kv_consumer", "kv_both")
KV_TRANSFER_STATS = ("kv_transfer_saves", "kv_transfer_loads", "kv_transfer_load_failures",
                     "kv_transfer_loaded_tokens", "kv_transfer_saved_bytes", "kv_transfer_loaded_bytes",
                     "kv_transfer_save_seconds", "kv_transfer_load_seconds", "kv_tier_queries", "kv_tier_hits",
                     "kv_tier_loads", "kv_tier_load_failures", "kv_tier_blocks", "kv_tier_offered_blocks",
                     "kv_tier_stored_blocks", "kv_tier_offers_dropped", "kv_tier_loaded_bytes", "kv_tier_load_seconds")


@dataclass
class Replica:
    """One engine replica as this gateway sees it."""

    address: str
    client: AsyncClient
    static: bool                  # given on the command line (kept even without a Redis entry)
    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0
    prefill_tokens_per_s: float = 0.0  # its measured pace (0.0: not measured yet), for cache-aware costs
    step_s: float = 0.0
    sent_since_update: int = 0    # requests routed here since the last load update
    healthy: bool = True
    load_ts: float = field(default=0.0)
    last_published: float = field(default_factory=time.monotonic)  # last seen in Redis (monotonic)
    index: PrefixIndex = field(default_factory=PrefixIndex)       # its cached blocks (cache-aware routing)
    dp_group: str | None = None   # its data-parallel expert-parallel group (from its Redis entry), if any
    dp_rank: int = 0
    kv_role: str = ""             # its --kv-transfer-config role (from its load), "" without one
    events_task: asyncio.Task | None = None                       # keeps `index` following its KV events

    @property
    def score(self) -> int:
        return WAITING_WEIGHT * (self.num_waiting + self.sent_since_update) + self.num_running

    @property
    def prefills(self) -> bool:
        """It prefills disaggregated requests (saves their prompt's KV for a decode replica)."""
        return self.kv_role in PRODUCER_ROLES

    @property
    def loads_remote_kv(self) -> bool:
        """It can decode a request another replica prefilled (loads that KV)."""
        return self.kv_role in CONSUMER_ROLES

    @property
    def prefill_only(self) -> bool:
        """A kv_producer: decodes go elsewhere while any other replica is up."""
        return self.kv_role == "kv_producer"

    def update_load(self, num_waiting: int, num_running: int, ts: float, kv_cache_usage: float = 0.0,
                    prefill_tokens_per_s: float = 0.0, step_s: float = 0.0) -> None:
        """A newer load report; the pace figures validated by the caller (0.0: not measured)."""
        if ts <= self.load_ts:
            return  # not newer than what we have: keep counting our own sends
        self.num_waiting, self.num_running, self.load_ts = num_waiting, num_running, ts
        self.kv_cache_usage = kv_cache_usage
        self.prefill_tokens_per_s, self.step_s = prefill_tokens_per_s, step_s
        self.sent_since_update = 0
        self.healthy = True


class ReplicaRouter:
    """Owns one scheduler client per replica and picks one per request."""

    def __init__(self, addresses: Iterable[str], redis_url: str | None = None, timeout_s: float = 1.5,
                 refresh_interval_s: float = REFRESH_INTERVAL_S, internal_token: str | None = None,
                 routing: RoutingConfig | None = None) -> None:
        self.timeout_s = timeout_s
        self.routing = routing or RoutingConfig()
        self._following = False  # KV event subscriptions run (started, cache-aware, several replicas)
        self._client_kwargs = {"token": internal_token} if internal_token else {}
        self._token = internal_token or None  # Redis entries must be signed with it
        self._rejected: set[tuple[str, str | None]] = set()  # refused Redis entries already logged
        # The last Redis read failed: the next good one restarts every replica's grace period.
        self._redis_was_down = False
        self.refresh_interval_s = refresh_interval_s
        self.replicas: dict[str, Replica] = {}
        # Engine requests routed to each replica since start (for /metrics): never reset, so a
        # replica that left and came back keeps its count.
        self.routed: Counter[str] = Counter()
        for address in addresses:
            self._add(address, static=True)
        self._redis = None
        self.waves: GroupWaves | None = None
        if redis_url:
            import redis.asyncio as aioredis

            self._redis = aioredis.from_url(redis_url)
            self.waves = GroupWaves(self._redis, self._token)
        if not self.replicas and self._redis is None:
            raise ValueError("the gateway needs at least one scheduler address or a redis URL to discover them")
        self._task: asyncio.Task | None = None
        self._first_round = asyncio.Event()  # set once the first round of load updates is done

    def _add(self, address: str, static: bool) -> Replica:
        replica = Replica(address, AsyncClient(address, timeout=self.timeout_s, **self._client_kwargs), static)
        self.replicas[address] = replica
        if self._following:
            self._follow(replica)
        return replica

    def _follow(self, replica: Replica) -> None:
        replica.events_task = asyncio.create_task(follow_kv_events(replica.client, replica.index),
                                                  name=f"myvllm-kv-events-{replica.address}")

    async def _drop(self, address: str) -> None:
        replica = self.replicas.pop(address)
        if replica.events_task is not None:
            replica.events_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await replica.events_task
        await replica.client.close()

    # ------------------------------------------------------------------ routing

    def pick(self, exclude: set[str] = frozenset(), prompt: RoutePrompt | None = None,
             prefill: bool = False) -> Replica:
        """The replica for the next request (counted as sent to it), by the routing policy;
        `prompt` lets cache-aware routing look up its cached prefix. Healthy replicas first;
        if every one is down, any (its error then tells the client); prefill-only replicas
        (kv_producer) only when no other is up. `prefill`: the prefill half of a disaggregated
        request instead, among the healthy replicas that prefill. Raises `SchedulerUnavailable`
        when no replica is known or all are excluded (with `prefill`: when none is up)."""
        candidates = [r for r in self.replicas.values() if r.address not in exclude]
        if prefill:
            candidates = [r for r in candidates if r.prefills and r.healthy]
            if not candidates:
                raise SchedulerUnavailable("no prefill replica is up")
        if not candidates:
            raise SchedulerUnavailable("no engine replica is available" if not exclude else
                                       f"every engine replica failed ({', '.join(sorted(exclude))})")
        healthy = [r for r in candidates if r.healthy]
        healthy = [r for r in healthy if not r.prefill_only] or healthy or candidates
        # Ties go to the replica with the oldest routing (dict order rotates in note_sent).
        policy = self.routing.policy
        if policy == RoutingPolicy.ROUND_ROBIN:
            chosen = healthy[0]
        elif policy == RoutingPolicy.CACHE_AWARE and prompt is not None and len(healthy) > 1:
            cached = [self.cached_tokens(r, prompt) for r in healthy]
            chosen = healthy[choose_cache_aware(
                self.routing, len(prompt.token_ids),
                [Candidate(r.score, r.kv_cache_usage, c, r.prefill_tokens_per_s, r.step_s)
                 for r, c in zip(healthy, cached, strict=True)])]
            logger.debug("routed a %d-token prompt to %s (cached tokens per replica: %s)", len(prompt.token_ids),
                         chosen.address, dict(zip((r.address for r in healthy), cached, strict=True)))
        else:
            chosen = min(healthy, key=lambda r: r.score)
        self.note_sent(chosen)
        return chosen

    def dp_wave_for(self, replica: Replica) -> int:
        """The wave a request sent to `replica` carries (0 outside an expert-parallel group); a
        paused group is told to start (FIRST_REQ)."""
        if replica.dp_group is None or self.waves is None:
            return 0
        return self.waves.before_send(replica.dp_group, replica.dp_rank)

    def cached_tokens(self, replica: Replica, prompt: RoutePrompt) -> int:
        """Tokens of `prompt`'s longest prefix that `replica` has cached, as its KV events tell
        (0 while its index is not in sync)."""
        index = replica.index
        if not index.synced or not index.block_size:
            return 0
        return index.num_leading_blocks(prompt.hashes(index.block_size)) * index.block_size

    def note_sent(self, replica: Replica) -> float:
        """Count a request routed to `replica` (until its next load update); returns the load
        report it is counted on top of, for `note_finished`."""
        replica.sent_since_update += 1
        self.routed[replica.address] += 1
        if self.replicas.get(replica.address) is replica:
            self.replicas.pop(replica.address)
            self.replicas[replica.address] = replica  # move to the end: round-robin among equals
        return replica.load_ts

    @staticmethod
    def note_finished(replica: Replica, sent_on: float) -> None:
        """A request `note_sent` counted on top of load report `sent_on` has ended: while that is
        still the replica's latest report, the request no longer waits there, so it stops counting
        (sequential requests ending between two reports would otherwise weigh as a queue, and
        cache-aware routing would send the next one away from its cached prefix)."""
        if replica.load_ts == sent_on and replica.sent_since_update > 0:
            replica.sent_since_update -= 1

    def ranked(self, avoid: set[str] = frozenset()) -> list[Replica]:
        """Every known replica, best first: healthy before down, lowest score first, and the
        ones in `avoid` (they just failed a request) last of all."""
        return sorted(self.replicas.values(),
                      key=lambda r: (r.address in avoid, not r.healthy, r.prefill_only, r.score))

    def disaggregates(self, replica: Replica, prompt: RoutePrompt) -> bool:
        """Whether `prompt`, decoding on `replica`, should be prefilled elsewhere first: `replica`
        loads remote KV, some other replica that prefills is up, and `replica` would otherwise
        compute more than a block of the prompt and at least --routing-remote-prefill-min-tokens
        (by its KV events: a prompt it has cached, say a repeated one, needs no transfer)."""
        if not replica.loads_remote_kv or not any(r.prefills and r.healthy and r is not replica
                                                  for r in self.replicas.values()):
            return False
        uncached = len(prompt.token_ids) - self.cached_tokens(replica, prompt)
        return uncached > (replica.index.block_size or 1) and uncached >= self.routing.remote_prefill_min_tokens

    def mark_down(self, replica: Replica, reason: BaseException) -> None:
        if replica.healthy:
            logger.warning("engine replica %s is down: %s", replica.address, reason)
        replica.healthy = False

    def mark_up(self, replica: Replica) -> None:
        """`replica` answered ready again. Load updates say so too where loads are followed;
        a single static replica has none, and would otherwise stay marked down for good (off
        engine_replicas_routable, and its next failure never logged)."""
        if not replica.healthy:
            logger.info("engine replica %s is back", replica.address)
        replica.healthy = True

    def any_client(self) -> AsyncClient:
        """A client for engine-wide questions (stats, max_model_len): a healthy replica's."""
        if not self.replicas:
            raise SchedulerUnavailable("no engine replica is known yet")
        healthy = [r for r in self.replicas.values() if r.healthy]
        return (healthy or list(self.replicas.values()))[0].client

    @property
    def description(self) -> str:
        names = ", ".join(self.replicas) or "none yet"
        return f"{names}{' (+ redis discovery)' if self._redis is not None else ''}"

    # ------------------------------------------------------------------ load updates

    @property
    def follows_loads(self) -> bool:
        """Whether replica loads are refreshed (not for a single static replica: nothing to choose)."""
        return self._redis is not None or len(self.replicas) > 1

    def start(self) -> None:
        """Start refreshing loads in the background, and with cache-aware routing following
        every replica's KV events (neither is needed for a single static replica)."""
        if self.follows_loads:
            self._task = asyncio.create_task(self._refresh_forever(), name="myvllm-router-refresh")
            if self.routing.policy == RoutingPolicy.CACHE_AWARE:
                self._following = True
                for replica in self.replicas.values():
                    self._follow(replica)
        else:
            self._first_round.set()  # nothing to hear: a single static replica is routable as it is

    async def first_round(self) -> None:
        """Wait (at most the client timeout) until the first round of load updates after start()
        is done, so that routable() has had its chance to see the replicas already up."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._first_round.wait(), self.timeout_s)

    async def _refresh_forever(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as e:  # keep routing on the last known loads
                logger.warning("refreshing replica loads failed: %s", e)
            self._first_round.set()
            await asyncio.sleep(self.refresh_interval_s)

    async def refresh(self) -> None:
        """One round of load updates: Redis entries, then GetLoad for replicas Redis does not cover."""
        published: set[str] = set()
        if self._redis is not None:
            try:
                loads = await redis_registry.read_engine_loads(
                    self._redis, max_age_s=REDIS_MAX_AGE_S, token=self._token, on_reject=self._log_rejected)
            except Exception as e:
                logger.warning("cannot read replica loads from redis: %s", e)
                loads = None
                self._redis_was_down = True
            if loads is not None:
                now = time.monotonic()
                if self._redis_was_down:
                    # Nobody could publish while Redis was away: an empty read right after it comes
                    # back says nothing yet, and must not drop every replica (and break their streams).
                    self._redis_was_down = False
                    for replica in self.replicas.values():
                        replica.last_published = now
                for entry in loads.values():
                    address = entry["address"]
                    replica = self.replicas.get(address) or self._add(address, static=False)
                    replica.update_load(int(entry["num_waiting"]), int(entry["num_running"]), float(entry["ts"]),
                                        float(entry.get("kv_cache_usage", 0.0)),
                                        redis_registry.measurement(entry.get("prefill_tokens_per_s")),
                                        redis_registry.measurement(entry.get("step_s")))
                    replica.last_published = now
                    replica.dp_group, replica.dp_rank = entry.get("dp_group"), int(entry.get("dp_rank", 0))
                    replica.kv_role = entry.get("kv_role", "")
                    published.add(address)
                groups = {r.dp_group for r in self.replicas.values() if r.dp_group is not None}
                if groups:
                    await self.waves.refresh(groups)
                # A replica missing from Redis is polled directly for a while before it is dropped:
                # a Redis that restarts empty must not cut off (and break the streams of) live
                # replicas in the second before they publish again.
                for address in [a for a, r in self.replicas.items() if not r.static and a not in published
                                and now - r.last_published > REDIS_MAX_AGE_S]:
                    logger.info("engine replica %s stopped publishing its load; no longer routed to", address)
                    await self._drop(address)
        polled = [r for r in self.replicas.values() if r.address not in published]
        await asyncio.gather(*(self._poll(r) for r in polled))

    def _log_rejected(self, engine_id: str, address: str | None, reason: str) -> None:
        """A Redis entry that is not routed to: logged once per (engine id, address), not at
        every refresh."""
        key = (engine_id, address)
        if key in self._rejected or len(self._rejected) > MAX_REJECTED_LOGGED:
            return
        self._rejected.add(key)
        if len(self._rejected) > MAX_REJECTED_LOGGED:
            logger.warning("more than %d refused redis entries: no more are logged", MAX_REJECTED_LOGGED)
            return
        logger.warning("ignoring redis entry %.100r (address %.300r): %s; never routed to", engine_id, address, reason)

    async def _poll(self, replica: Replica) -> None:
        try:
            load = await replica.client.get_load()
        except SchedulerUnavailable as e:
            self.mark_down(replica, e)
            return
        replica.update_load(load.num_waiting, load.num_running, time.time(), load.kv_cache_usage,
                            redis_registry.measurement(load.prefill_tokens_per_s),
                            redis_registry.measurement(load.step_s))
        replica.kv_role = load.kv_role

    # ------------------------------------------------------------------ engine-wide views

    async def replica_stats(self) -> dict[str, pb.Stats]:
        """Each reachable replica's stats, by address (one that does not answer is left out)."""
        replicas = list(self.replicas.values())
        results = await asyncio.gather(*(r.client.get_stats() for r in replicas), return_exceptions=True)
        return {r.address: s for r, s in zip(replicas, results, strict=True) if isinstance(s, pb.Stats)}

    async def stats(self) -> pb.Stats | None:
        """Every reachable replica's stats summed (KV usage over all blocks); None if none answers."""
        answered = list((await self.replica_stats()).values())
        if len(answered) <= 1:
            return answered[0] if answered else None
        total = pb.Stats(model=answered[0].model, block_size=answered[0].block_size,
                         max_model_len=min(s.max_model_len for s in answered))
        for s in answered:
            total.num_free_blocks += s.num_free_blocks
            total.num_total_blocks += s.num_total_blocks
            total.prefix_cache_queries += s.prefix_cache_queries
            total.prefix_cache_hits += s.prefix_cache_hits
            total.num_preemptions += s.num_preemptions
            total.prompt_tokens += s.prompt_tokens
            total.generation_tokens += s.generation_tokens
            total.num_waiting += s.num_waiting
            total.num_waiting_deferred += s.num_waiting_deferred
            total.num_running += s.num_running
            total.num_steps += s.num_steps
            total.grammar_compiles += s.grammar_compiles
            total.grammar_compile_seconds += s.grammar_compile_seconds
            total.grammar_cache_hits += s.grammar_cache_hits
            total.grammar_compile_timeouts += s.grammar_compile_timeouts
            total.grammar_row_waits += s.grammar_row_waits
            total.num_dummy_steps += s.num_dummy_steps
            total.cudagraph_capture_failures += s.cudagraph_capture_failures
            for name in KV_TRANSFER_STATS:
                setattr(total, name, getattr(total, name) + getattr(s, name))
            total.dp_wave = max(total.dp_wave, s.dp_wave)
            total.max_lora = max(total.max_lora, s.max_lora)
            # (An adapter must fit every replica's rank bound.)
            total.max_lora_rank = min(total.max_lora_rank or s.max_lora_rank, s.max_lora_rank)
            total.running_lora_adapters[:] = sorted({*total.running_lora_adapters, *s.running_lora_adapters})
            total.waiting_lora_adapters[:] = sorted({*total.waiting_lora_adapters, *s.waiting_lora_adapters})
            total.dp_engines_running |= s.dp_engines_running
            total.dp_wave_messages_stale += s.dp_wave_messages_stale
            total.dp_wave_messages_replayed += s.dp_wave_messages_replayed
            _add_spec_and_iteration_stats(total, s)
        if total.num_total_blocks:
            total.kv_cache_usage = 1.0 - total.num_free_blocks / total.num_total_blocks
        return total

    def routable(self) -> Counter[str]:
        """The replicas requests go to now (answering, their load heard, so their KV role known;
        a single static replica: unless marked down), counted by KV role ("none" without a connector)."""
        return Counter(r.kv_role or "none" for r in self.replicas.values()
                       if r.healthy and (r.load_ts > 0 or not self.follows_loads))

    async def healthy(self) -> bool:
        """Whether at least one replica passes its health check."""
        results = await asyncio.gather(*(r.client.health() for r in self.replicas.values()), return_exceptions=True)
        return any(result is True for result in results)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for address in list(self.replicas):
            await self._drop(address)
        if self._redis is not None:
            await self._redis.aclose()


def _add_spec_and_iteration_stats(total: pb.Stats, s: pb.Stats) -> None:
    """Speculative decoding's counters and the tokens-per-step histogram, summed over replicas."""
    total.spec_decode_enabled |= s.spec_decode_enabled
    total.enable_prefix_caching |= s.enable_prefix_caching
    total.spec_decode_num_drafts += s.spec_decode_num_drafts
    total.spec_decode_num_draft_tokens += s.spec_decode_num_draft_tokens
    total.spec_decode_num_accepted_tokens += s.spec_decode_num_accepted_tokens
    total.spec_decode_accepted_per_pos[:] = _sum_lists(total.spec_decode_accepted_per_pos,
                                                       s.spec_decode_accepted_per_pos)
    total.iteration_tokens_counts[:] = _sum_lists(total.iteration_tokens_counts, s.iteration_tokens_counts)
    total.iteration_tokens_sum += s.iteration_tokens_sum


def _sum_lists(a: Sequence[int], b: Sequence[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]
