"""Cache-aware routing, piece by piece, without model processes: the shared block hash
(gateway == scheduler), the scheduler's KV event log driven by a real KVCacheManager, the
gateway's prefix index following it (and resyncing after a dropped subscription, also over
real gRPC with a server that goes away and comes back), the routing cost and policies, the
load reporter's trailing write, and the routing metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest
from support.processes import free_port

from services.client.grpc_client import AsyncClient
from services.common.block_hash import NONE_HASH, block_hashes
from services.common.proto import myvllm_pb2 as pb
from services.common.proto import myvllm_pb2_grpc as pb_grpc
from services.engine.kv_cache_manager import KVCacheManager
from services.engine.request import Request
from services.gateway.kv_subscriber import follow_kv_events
from services.gateway.metrics import GatewayMetrics
from services.gateway.prefix_index import KvEventGap, PrefixIndex
from services.gateway.router import ReplicaRouter
from services.gateway.routing import (
    DEFAULT_PREFILL_TOKENS_PER_S,
    DEFAULT_STEP_S,
    Candidate,
    RoutePrompt,
    RoutingConfig,
    choose_cache_aware,
    cost,
    with_measured_pace,
)
from services.scheduler.kv_events import KvEventLog, SubscriberTooSlow

B = 4  # tokens per block


def _request(request_id: str, tokens: list[int], salt: str = "") -> Request:
    return Request(request_id, list(tokens), pb.SamplingParams(max_tokens=1), frozenset(), max_tokens=1,
                   cache_salt=salt)


def _manager(num_blocks: int, max_queued_batches: int = 1024) -> tuple[KVCacheManager, KvEventLog]:
    manager = KVCacheManager(num_blocks, B)
    log = KvEventLog(B, max_queued_batches)
    manager.block_pool.events = log
    return manager, log


# ---------------------------------------------------------------------- one hash for both sides


@pytest.mark.parametrize("salt", ["", "tenant-a"])
def test_gateway_hashes_equal_the_schedulers(salt: str) -> None:
    tokens = list(range(100, 100 + 4 * B + 2))  # 4 full blocks and 2 tokens
    manager, log = _manager(32)
    request = _request("r", tokens, salt)
    manager.allocate_slots(request, request.num_tokens)
    cached = set(manager.block_pool.cached_blocks)
    assert len(cached) == 4
    assert {e.stored.block_hash for e in log.snapshot().events} == cached
    gateway = RoutePrompt(tokens, salt).hashes(B)
    assert gateway == request.block_hashes == block_hashes(tokens, B, salt)
    assert set(gateway) == cached
    # A gateway index fed by those events finds the whole cached prefix of a longer prompt,
    # and nothing of the same tokens under another salt.
    index = PrefixIndex()
    index.apply(log.snapshot())
    assert index.num_leading_blocks(RoutePrompt([*tokens, 1, 2, 3], salt).hashes(B)) == 4
    assert index.num_leading_blocks(RoutePrompt(tokens, salt + "x").hashes(B)) == 0


def test_route_prompt_never_counts_the_block_of_the_last_token() -> None:
    """The scheduler always computes the last prompt token, so a prompt of exactly k blocks
    can hit at most k - 1 of them."""
    assert len(RoutePrompt(list(range(2 * B))).hashes(B)) == 1
    assert len(RoutePrompt(list(range(2 * B + 1))).hashes(B)) == 2
    assert RoutePrompt([]).hashes(B) == []


def test_salt_goes_into_every_block_through_the_chain() -> None:
    tokens = list(range(3 * B))
    plain, salted = block_hashes(tokens, B), block_hashes(tokens, B, "s")
    assert all(p != s for p, s in zip(plain, salted, strict=True))
    assert block_hashes(tokens, B, "s") == salted  # deterministic
    assert plain[0] != NONE_HASH
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(tokens, 0)


# ---------------------------------------------------------------------- events → index


def test_index_follows_stored_removed_and_cleared() -> None:
    async def scenario() -> None:
        manager, log = _manager(9)  # 8 usable blocks
        stream = log.subscribe()
        index = PrefixIndex()
        index.apply(await anext(stream))
        assert index.synced and index.hashes == set()

        async def step() -> None:
            log.flush()
            index.apply(await anext(stream))
            assert index.seq == log.seq
            assert index.hashes == set(manager.block_pool.cached_blocks)

        a = _request("a", list(range(3 * B + 1)))
        manager.allocate_slots(a, a.num_tokens)
        await step()
        a_hashes = set(index.hashes)
        assert len(a_hashes) == 3                     # stored
        manager.free(a)                               # freed blocks stay cached: no event
        b = _request("b", list(range(1000, 1000 + 8 * B)))
        manager.allocate_slots(b, b.num_tokens)       # needs every block: a's are evicted
        await step()
        assert a_hashes.isdisjoint(index.hashes) and len(index.hashes) == 8  # removed + stored
        manager.free(b)
        manager.block_pool.reset_prefix_cache()
        await step()
        assert index.hashes == set()                  # cleared
        await stream.aclose()

    asyncio.run(scenario())


def test_the_kv_tiers_blocks_reach_the_index_with_their_medium_and_outlive_a_cleared_cache() -> None:
    from services.engine.kv_tier import KVTierScheduler

    async def scenario() -> None:
        manager, log = _manager(9)
        tier = KVTierScheduler(B)
        tier.events, tier.medium = log, "DISK"
        stream = log.subscribe()
        index = PrefixIndex()
        index.apply(await anext(stream))
        a = _request("a", list(range(3 * B + 1)))
        manager.allocate_slots(a, a.num_tokens)
        tier.observe(pb.ModelRunnerOutput(kv_tier_stored=a.block_hashes[:3]))  # the worker stored them too
        log.flush()
        batch = await anext(stream)
        assert {e.stored.medium for e in batch.events} == {"", "DISK"}
        index.apply(batch)
        assert index.tier == set(a.block_hashes[:3]) == index.hashes
        manager.free(a)
        manager.block_pool.reset_prefix_cache()  # the worker is lost: its cache, not its tier
        tier.observe(pb.ModelRunnerOutput(kv_tier_removed=a.block_hashes[2:3]))
        log.flush()
        index.apply(await anext(stream))
        assert index.hashes == set() and index.tier == set(a.block_hashes[:2])
        assert index.num_leading_blocks(a.block_hashes[:3]) == 2  # routing counts the tier's blocks
        late = PrefixIndex()  # a gateway subscribing now gets them in its snapshot
        fresh = log.subscribe()
        late.apply(await anext(fresh))
        assert late.tier == index.tier and late.hashes == set()
        await stream.aclose()
        await fresh.aclose()

    asyncio.run(scenario())


def test_index_resyncs_after_a_dropped_subscription() -> None:
    async def scenario() -> None:
        manager, log = _manager(64, max_queued_batches=2)
        slow = log.subscribe()
        index = PrefixIndex()
        index.apply(await anext(slow))
        for i in range(3):  # three steps while the subscriber reads nothing: one too many
            r = _request(f"r{i}", list(range(100 * i, 100 * i + 2 * B + 1)))
            manager.allocate_slots(r, r.num_tokens)
            log.flush()
        with pytest.raises(SubscriberTooSlow):
            await anext(slow)
        assert index.hashes != set(manager.block_pool.cached_blocks)  # behind
        index.reset()
        fresh = log.subscribe()
        index.apply(await anext(fresh))  # the snapshot
        assert index.hashes == set(manager.block_pool.cached_blocks) and len(index.hashes) == 6
        await fresh.aclose()

    asyncio.run(scenario())


def test_a_missing_batch_resets_the_index() -> None:
    index = PrefixIndex()
    stored = pb.KvEvent(stored=pb.KvBlockStored(block_hash=b"h" * 32, block_size=B))
    with pytest.raises(KvEventGap, match="expected a snapshot"):
        index.apply(pb.KvEventBatch(seq=1, events=[stored]))
    index.apply(pb.KvEventBatch(seq=5, snapshot=True, events=[stored], block_size=B))
    assert index.hashes == {b"h" * 32} and index.block_size == B
    with pytest.raises(KvEventGap, match="expected batch 6, got batch 7"):
        index.apply(pb.KvEventBatch(seq=7))
    assert not index.synced and index.hashes == set()


class _EventsOnlyScheduler(pb_grpc.SchedulerServicer):
    """Just enough of a scheduler for a KV event subscription: Health and SubscribeKvEvents."""

    def __init__(self, log: KvEventLog) -> None:
        self.log = log

    async def Health(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        return pb.HealthResponse(ok=True, detail="ready")

    async def SubscribeKvEvents(self, request: pb.Empty, context: grpc.aio.ServicerContext):
        async for batch in self.log.subscribe():
            yield batch


async def _serve(address: str, log: KvEventLog) -> grpc.aio.Server:
    server = grpc.aio.server()
    pb_grpc.add_SchedulerServicer_to_server(_EventsOnlyScheduler(log), server)
    server.add_insecure_port(address)
    await server.start()
    return server


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.02)


def test_subscriber_drops_the_index_when_the_scheduler_goes_and_resyncs_when_it_is_back() -> None:
    h1, h2, h3 = (bytes([i]) * 32 for i in (1, 2, 3))

    async def scenario() -> None:
        address = f"127.0.0.1:{free_port()}"
        first = KvEventLog(B)
        first.stored(h1, NONE_HASH)
        server = await _serve(address, first)
        client = AsyncClient(address, timeout=1.0)
        index = PrefixIndex()
        task = asyncio.create_task(follow_kv_events(client, index, backoff_s=0.05, max_backoff_s=0.2))
        try:
            await _until(lambda: index.hashes == {h1}, "the snapshot arrived")
            first.stored(h2, h1)
            first.flush()
            await _until(lambda: index.hashes == {h1, h2}, "a batch arrived")
            await server.stop(None)                   # the scheduler goes away
            await _until(lambda: not index.synced and not index.hashes, "the index was dropped")
            second = KvEventLog(B)                    # and comes back, with another cache
            second.stored(h3, NONE_HASH)
            server = await _serve(address, second)
            await _until(lambda: index.hashes == {h3}, "the index resynced")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.close()
            await server.stop(None)

    asyncio.run(scenario())


# ---------------------------------------------------------------------- cost and policies


def test_cost_prefers_cached_prefix_within_the_imbalance_bound() -> None:
    # 1000 prompt tokens/s and 10 ms steps: a load unit (a quarter step) is worth 2.5 prompt tokens.
    config = RoutingConfig(max_imbalance=16)
    pace = {"prefill_tokens_per_s": 1000.0, "step_s": 0.01}
    idle_cold, busy_warm = Candidate(0, 0, 0, **pace), Candidate(8, 0, 96, **pace)
    assert choose_cache_aware(config, 100, [idle_cold, busy_warm]) == 1      # 4 ms + 20 ms < 100 ms
    assert choose_cache_aware(config, 100, [idle_cold, Candidate(17, 0, 96, **pace)]) == 0  # over the bound
    # KV pressure: a full cache costs a step, as much as 10 prompt tokens here.
    assert choose_cache_aware(config, 100, [Candidate(0, 1.0, 0, **pace), Candidate(0, 0, 0, **pace)]) == 1
    assert choose_cache_aware(config, 100, [Candidate(0, 1.0, 12, **pace), Candidate(0, 0, 0, **pace)]) == 0


def test_a_queued_replica_with_the_prefix_wins_while_its_prefill_is_slow_and_loses_to_a_long_queue() -> None:
    """The trade is in seconds: 2 waiting requests (load 8) ahead on the replica with a 400-token
    prefix cached, against an idle replica without it."""
    config = RoutingConfig()
    prompt, cached = 416, 400

    def choice(rate: float, step_s: float, load: float) -> int:
        return choose_cache_aware(config, prompt, [Candidate(0, 0, 0, rate, step_s),
                                                   Candidate(load, 0, cached, rate, step_s)])

    # Slow prefill (400 tokens take 0.8 s), 50 ms steps: two steps of queue are cheaper.
    assert choice(rate=500, step_s=0.05, load=8) == 1
    # The same queue on fast prefill (400 tokens in 40 ms) is not worth waiting for.
    assert choice(rate=10_000, step_s=0.05, load=8) == 0
    # Slow prefill but a long queue: 24 waiting requests ahead are 1.2 s, more than the 0.8 s prefill.
    assert choose_cache_aware(RoutingConfig(max_imbalance=1000), prompt,
                              [Candidate(0, 0, 0, 500, 0.05), Candidate(4 * 24, 0, cached, 500, 0.05)]) == 0
    assert choose_cache_aware(RoutingConfig(max_imbalance=1000), prompt,
                              [Candidate(0, 0, 0, 500, 0.05), Candidate(4 * 12, 0, cached, 500, 0.05)]) == 1


def test_each_replica_is_costed_at_its_own_pace() -> None:
    """The same cached prefix is worth more on a slow replica: an idle fast replica without it
    beats a queued slow one with it."""
    fast_cold = Candidate(0, 0, 0, prefill_tokens_per_s=20_000, step_s=0.01)
    slow_warm = Candidate(8, 0, 400, prefill_tokens_per_s=500, step_s=0.2)
    assert choose_cache_aware(RoutingConfig(), 416, [fast_cold, slow_warm]) == 0
    assert cost(416, fast_cold) == pytest.approx(416 / 20_000)
    assert cost(416, slow_warm) == pytest.approx(16 / 500 + 2 * 0.2)


def test_unmeasured_replicas_borrow_the_measured_pace_or_the_defaults() -> None:
    unmeasured = Candidate(4, 0.5, 0)
    (default,) = with_measured_pace([unmeasured])
    assert (default.prefill_tokens_per_s, default.step_s) == (DEFAULT_PREFILL_TOKENS_PER_S, DEFAULT_STEP_S)
    # The defaults keep the earlier weights' trade: a waiting request ahead is worth 256 prompt tokens.
    assert DEFAULT_STEP_S * DEFAULT_PREFILL_TOKENS_PER_S == pytest.approx(256)
    assert choose_cache_aware(RoutingConfig(), 300, [Candidate(0, 0, 0), Candidate(4, 0, 257)]) == 1
    assert choose_cache_aware(RoutingConfig(), 300, [Candidate(0, 0, 0), Candidate(4, 0, 255)]) == 0
    # One replica measured: the other borrows its figures (the mean of all that measured), so a
    # replica that just joined is not priced on another scale.
    measured = [Candidate(0, 0, 0, 1000, 0.02), Candidate(0, 0, 0, 3000, 0.04), unmeasured]
    borrowed = with_measured_pace(measured)[2]
    assert (borrowed.prefill_tokens_per_s, borrowed.step_s) == (2000, pytest.approx(0.03))
    assert with_measured_pace(measured)[:2] == measured[:2]
    half = with_measured_pace([Candidate(0, 0, 0, 1000, 0.0), Candidate(0, 0, 0, 0.0, 0.5)])
    assert [(c.prefill_tokens_per_s, c.step_s) for c in half] == [(1000, 0.5), (1000, 0.5)]


def _router(policy: str, step_s: float = 0.0, **config: float) -> ReplicaRouter:
    """Two replicas, idle; `step_s` as they measured it (with slow prefill), 0: not measured."""
    router = ReplicaRouter(["a:1", "b:2"], routing=RoutingConfig(policy, **config))
    for replica in router.replicas.values():
        replica.update_load(0, 0, ts=1.0, prefill_tokens_per_s=100.0 if step_s else 0.0, step_s=step_s)
        replica.index.apply(pb.KvEventBatch(seq=1, snapshot=True, block_size=B))
    return router


def _cache(router: ReplicaRouter, address: str, hashes: list[bytes]) -> None:
    index = router.replicas[address].index
    index.apply(pb.KvEventBatch(seq=index.seq + 1, block_size=B, events=[
        pb.KvEvent(stored=pb.KvBlockStored(block_hash=h, block_size=B)) for h in hashes]))


PROMPT = RoutePrompt(list(range(16 * B + 1)))  # 16 cacheable blocks


def test_router_picks_the_longest_cached_prefix_until_load_is_over_the_bound() -> None:
    # 100 prompt tokens/s, 4 ms steps: a load unit (1 ms) is worth a tenth of a prompt token.
    router = _router("cache-aware", step_s=0.004, max_imbalance=16)
    _cache(router, "a:1", PROMPT.hashes(B)[:4])    # 16 tokens cached
    _cache(router, "b:2", PROMPT.hashes(B)[:12])   # 48 tokens cached
    assert router.cached_tokens(router.replicas["b:2"], PROMPT) == 12 * B
    # Each send adds 4 to b's load (optimistically, until its next load update): b keeps
    # winning on cost until its load is more than 16 above a's.
    picks = [router.pick(prompt=PROMPT).address for _ in range(6)]
    assert picks == ["b:2"] * 5 + ["a:1"]


def test_requests_that_ended_before_the_next_load_report_stop_counting_as_queued() -> None:
    """Sequential requests (each ends before the next is sent) within one load-report window:
    the ones that ended no longer weigh as a queue on the replica holding the prefix, so the
    next one still goes there (counted as queued, two of them outweighed the saved prefill and
    the third went to the other replica: the e2e routing test's flake under a busy CPU)."""
    # a prefill of the whole prompt costs 0.25 s; each queued request ahead one 0.25 s step
    router = _router("cache-aware", step_s=0.25)
    for replica in router.replicas.values():
        replica.update_load(0, 0, ts=2.0, prefill_tokens_per_s=len(PROMPT.token_ids) / 0.25, step_s=0.25)
    _cache(router, "b:2", PROMPT.hashes(B))
    picks = []
    for _ in range(4):
        replica = router.pick(prompt=PROMPT)
        picks.append(replica.address)
        router.note_finished(replica, sent_on=2.0)  # it ended; still no newer load report
    assert picks == ["b:2"] * 4
    # A request sent before the latest report is in that report: its end changes nothing.
    replica = router.pick(prompt=PROMPT)
    replica.update_load(0, 1, ts=3.0, prefill_tokens_per_s=len(PROMPT.token_ids) / 0.25, step_s=0.25)
    assert router.pick(prompt=PROMPT) is replica
    router.note_finished(replica, sent_on=2.0)
    assert replica.sent_since_update == 1


def test_a_replica_whose_index_is_not_synced_counts_as_cold() -> None:
    router = _router("cache-aware")
    _cache(router, "b:2", PROMPT.hashes(B))
    router.replicas["b:2"].index.reset()  # its event stream broke
    assert router.cached_tokens(router.replicas["b:2"], PROMPT) == 0
    assert router.pick(prompt=PROMPT).address == "a:1"  # equal cost: first in order


@pytest.mark.parametrize("policy, expected", [("load", ["a:1", "b:2", "a:1", "b:2"]),
                                              ("round-robin", ["a:1", "b:2", "a:1", "b:2"])])
def test_other_policies_ignore_the_cache(policy: str, expected: list[str]) -> None:
    router = _router(policy)
    _cache(router, "b:2", PROMPT.hashes(B))
    assert [router.pick(prompt=PROMPT).address for _ in range(4)] == expected


def test_round_robin_ignores_load() -> None:
    router = _router("round-robin")
    router.replicas["a:1"].update_load(10, 10, ts=2.0)
    assert [router.pick().address for _ in range(4)] == ["a:1", "b:2", "a:1", "b:2"]


def test_routing_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="bogus"):
        RoutingConfig("bogus")
    with pytest.raises(ValueError, match="--routing-max-imbalance must not be negative"):
        RoutingConfig(max_imbalance=-1)


# ---------------------------------------------------------------------- load reporter, metrics


class _FakeRedis:
    def __init__(self) -> None:
        self.writes: list[str] = []

    async def hset(self, key: str, field: str, value: str) -> None:
        self.writes.append(value)


def test_load_reporter_sends_a_held_back_change_without_waiting_for_a_step() -> None:
    import json

    from services.scheduler.load_reporter import LoadReporter

    async def scenario() -> None:
        reporter = LoadReporter("redis://127.0.0.1:1", "e", "a:1", min_interval_s=0.1)  # never dialled
        reporter.client = _FakeRedis()
        reporter.report(pb.Load(num_waiting=1, num_running=0))
        reporter.report(pb.Load(num_waiting=2, num_running=1))   # within 100 ms: held back
        reporter.report(pb.Load(num_waiting=3, num_running=1))   # the latest one wins
        await asyncio.sleep(0.02)
        assert [json.loads(w)["num_waiting"] for w in reporter.client.writes] == [1]
        await asyncio.sleep(0.15)                                # no further report() call
        assert [json.loads(w)["num_waiting"] for w in reporter.client.writes] == [1, 3]

    asyncio.run(scenario())


def test_load_reporter_publishes_the_measured_pace_without_writing_for_it_alone() -> None:
    import json

    from services.scheduler.load_reporter import LoadReporter

    async def scenario() -> None:
        reporter = LoadReporter("redis://127.0.0.1:1", "e", "a:1", min_interval_s=0.0)  # never dialled
        reporter.client = _FakeRedis()
        reporter.report(pb.Load(num_waiting=1, prefill_tokens_per_s=1234.56, step_s=0.0421234567))
        await asyncio.sleep(0)
        reporter.report(pb.Load(num_waiting=1, prefill_tokens_per_s=999.0, step_s=0.5))  # only the pace moved
        await asyncio.sleep(0.02)
        (entry,) = [json.loads(w) for w in reporter.client.writes]
        assert (entry["prefill_tokens_per_s"], entry["step_s"]) == (1234.6, 0.042123)

    asyncio.run(scenario())


@pytest.mark.parametrize("value, expected", [
    (2000.0, 2000.0), (3, 3.0), (None, 0.0), (0, 0.0), (-1.5, 0.0), (float("nan"), 0.0), (float("inf"), 0.0),
    (1e300, 0.0), ("fast", 0.0), (True, 0.0), ([1.0], 0.0)])
def test_a_published_measurement_is_used_only_when_a_finite_positive_number(value: object, expected: float) -> None:
    from services.common.redis_registry import measurement

    assert measurement(value) == expected


class _EntriesRedis:
    """A Redis whose engines hash holds what the test wrote there, as raw JSON text."""

    def __init__(self, entries: dict[str, str]) -> None:
        self.entries = entries

    async def hgetall(self, key: str) -> dict[bytes, bytes]:
        return {k.encode(): v.encode() for k, v in self.entries.items()}

    async def aclose(self) -> None:
        pass


def test_bad_pace_in_redis_falls_back_and_never_stops_routing() -> None:
    """Redis is a trust boundary: a missing, negative, NaN or mistyped pace counts as not
    measured (the replica borrows the others' figures); the entry itself is still routed to."""
    now = time.time()

    def entry(address: str, pace: str) -> str:
        return f'{{"address": "{address}", "num_waiting": 0, "num_running": 0, "ts": {now}{pace}}}'

    async def scenario() -> None:
        router = ReplicaRouter([], redis_url="redis://127.0.0.1:1", routing=RoutingConfig("cache-aware"))
        router._redis = _EntriesRedis({
            "good": entry("10.0.0.1:1", ', "prefill_tokens_per_s": 500.0, "step_s": 0.05'),
            "nan": entry("10.0.0.2:1", ', "prefill_tokens_per_s": NaN, "step_s": -1'),
            "text": entry("10.0.0.3:1", ', "prefill_tokens_per_s": "fast", "step_s": Infinity'),
            "none": entry("10.0.0.4:1", ""),
        })
        try:
            await router.refresh()
            paces = {a: (r.prefill_tokens_per_s, r.step_s) for a, r in router.replicas.items()}
            assert paces == {"10.0.0.1:1": (500.0, 0.05), "10.0.0.2:1": (0.0, 0.0), "10.0.0.3:1": (0.0, 0.0),
                             "10.0.0.4:1": (0.0, 0.0)}
            picked = {router.pick(prompt=PROMPT).address for _ in range(8)}
            assert picked == set(paces)  # every replica routable; equal costs rotate
        finally:
            await router.close()

    asyncio.run(scenario())


def test_get_load_pace_is_validated_too() -> None:
    router = ReplicaRouter(["a:1", "b:2"])
    replica = router.replicas["a:1"]

    async def scenario() -> None:
        async def get_load() -> pb.Load:
            return pb.Load(num_waiting=1, prefill_tokens_per_s=float("nan"), step_s=0.25)

        replica.client.get_load = get_load
        await router._poll(replica)
        assert (replica.num_waiting, replica.prefill_tokens_per_s, replica.step_s) == (1, 0.0, 0.25)
        await router.close()

    asyncio.run(scenario())


def test_metrics_count_predicted_and_actual_cached_tokens() -> None:
    metrics = GatewayMetrics("m")
    metrics.on_routed_prompt(64, 48)
    metrics.on_routed_prompt(0, 16)
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.render(None, {"a:1": 2})) for s in family.samples}
    model = (("model_name", "m"),)
    assert samples[("myvllm:routing_predicted_cached_tokens_total", model)] == 64
    assert samples[("myvllm:routing_actual_cached_tokens_total", model)] == 64
    assert samples[("myvllm:routing_prompts_total", model)] == 2
    assert samples[("myvllm:replica_requests_total", (*model, ("replica", "a:1")))] == 2


# ---------------------------------------------------------------------- the bench workload


def test_multi_tenant_workload_interleaves_tenants_sharing_system_prompts() -> None:
    from services.entrypoints.bench.multi_tenant import tenant_requests

    requests = tenant_requests(num_tenants=3, users_per_tenant=2, system_len=20, question_len=4, output_len=5,
                               vocab_size=1000, seed=0)
    assert len(requests) == 6 and all(r.prompt_len == 24 and r.output_len == 5 for r in requests)
    systems = [tuple(r.prompt_token_ids[:20]) for r in requests]
    assert len(set(systems)) == 3                                  # one system prompt per tenant
    assert set(systems[:3]) == set(systems[3:]) == set(systems)    # every round has every tenant once
    assert len({tuple(r.prompt_token_ids[20:]) for r in requests}) == 6  # distinct questions
    with pytest.raises(ValueError, match="at least 1"):
        tenant_requests(0, 1, 1, 1, 1, 1000, 0)
