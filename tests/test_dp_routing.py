"""Data-parallel routing in the gateway.

Unit tests of `ReplicaRouter.pick` (scores, bursts between load updates, replicas going
down), then the real thing: two engine replicas (worker + scheduler processes) publishing
their load to a real redis-server, a gateway that only knows Redis, the official openai
client; requests spread over both replicas, and when one replica dies the other serves.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import free_port
from replica import Replica

from services.gateway.router import REDIS_MAX_AGE_S, REFRESH_INTERVAL_S, ReplicaRouter
from services.gateway.server import BackgroundGateway
from services.sdk.client import SchedulerUnavailable

# ---------------------------------------------------------------------- pick()


def _router(*addresses: str) -> ReplicaRouter:
    return ReplicaRouter(list(addresses))  # clients connect lazily: nothing is dialled here


def test_pick_prefers_the_lowest_score_with_waiting_weighted_four_times() -> None:
    router = _router("a:1", "b:2")
    router.replicas["a:1"].update_load(num_waiting=1, num_running=0, ts=1.0)  # score 4
    router.replicas["b:2"].update_load(num_waiting=0, num_running=3, ts=1.0)  # score 3
    assert router.pick().address == "b:2"


def test_burst_between_updates_spreads_over_replicas() -> None:
    router = _router("a:1", "b:2", "c:3")
    for replica in router.replicas.values():
        replica.update_load(0, 0, ts=1.0)
    picks = Counter(router.pick().address for _ in range(9))
    assert picks == {"a:1": 3, "b:2": 3, "c:3": 3}
    # A newer load update replaces the local counts; an older one is ignored.
    router.replicas["a:1"].update_load(0, 0, ts=2.0)
    router.replicas["b:2"].update_load(5, 0, ts=0.5)
    assert router.replicas["a:1"].sent_since_update == 0
    assert router.replicas["b:2"].num_waiting == 0 and router.replicas["b:2"].sent_since_update == 3
    assert router.pick().address == "a:1"


def test_down_replicas_are_skipped_until_none_is_left() -> None:
    router = _router("a:1", "b:2")
    router.mark_down(router.replicas["a:1"], SchedulerUnavailable("gone"))
    assert {router.pick().address for _ in range(4)} == {"b:2"}
    router.mark_down(router.replicas["b:2"], SchedulerUnavailable("gone"))
    assert router.pick().address in {"a:1", "b:2"}  # all down: try anyway (the error reaches the client)
    with pytest.raises(SchedulerUnavailable, match="every engine replica failed"):
        router.pick(exclude={"a:1", "b:2"})
    # A fresh load update brings a replica back.
    router.replicas["a:1"].update_load(0, 0, ts=time.time())
    assert router.replicas["a:1"].healthy


def test_a_replica_missing_from_redis_is_kept_for_a_grace_period(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Redis that comes back empty must not cut off live replicas before they publish again."""
    import services.scheduler.load_reporter as load_reporter

    address = f"127.0.0.1:{free_port()}"  # nobody listens: direct polls fail
    published: dict[str, dict] = {"e1": {"address": address, "num_waiting": 0, "num_running": 1, "ts": time.time()}}

    async def fake_read(client: object, max_age_s: float = 10.0) -> dict[str, dict]:
        return dict(published)

    monkeypatch.setattr(load_reporter, "read_engine_loads", fake_read)

    async def scenario() -> None:
        router = ReplicaRouter([], redis_url="redis://127.0.0.1:1")  # never dialled: reads are faked
        try:
            await router.refresh()
            assert list(router.replicas) == [address] and router.replicas[address].healthy
            published.clear()  # Redis restarted empty
            await router.refresh()
            assert list(router.replicas) == [address]  # kept (and polled directly meanwhile)
            router.replicas[address].last_published -= REDIS_MAX_AGE_S + 1
            await router.refresh()
            assert router.replicas == {}
        finally:
            await router.close()

    asyncio.run(scenario())


def test_router_needs_a_replica_or_redis() -> None:
    with pytest.raises(ValueError, match="scheduler address or a redis URL"):
        ReplicaRouter([])


# ---------------------------------------------------------------------- two real replicas


def test_gateway_routes_over_replicas_found_in_redis(smollm2_dir: str, redis_server: str) -> None:
    import openai

    replicas = [Replica(smollm2_dir, redis_server) for _ in range(2)]
    try:
        for replica in replicas:
            replica.wait_ready()
        # The gateway is told only where Redis is.
        with BackgroundGateway("", smollm2_dir, redis_url=redis_server) as gateway:
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0, timeout=120)
            deadline = time.monotonic() + 30
            while True:  # both replicas discovered (the router reads Redis every 0.25 s)
                known = asyncio.run(_published_addresses(redis_server))
                if known == {r.address for r in replicas}:
                    break
                assert time.monotonic() < deadline, f"replicas never published their load: {known}"
                time.sleep(0.25)
            time.sleep(4 * REFRESH_INTERVAL_S)  # and the gateway's router has read them

            def ask(i: int) -> str:
                reply = client.chat.completions.create(
                    model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is 2+2?"}],
                    temperature=0, max_tokens=6)
                return reply.choices[0].message.content

            steps_before = [r.num_steps() for r in replicas]
            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(ask, range(8)))
            assert len(set(answers)) == 1 and answers[0]  # greedy: the same answer from either replica
            steps = [r.num_steps() - b for r, b in zip(replicas, steps_before, strict=True)]
            assert all(s > 0 for s in steps), f"a replica served nothing: steps per replica {steps}"

            # One replica dies: requests keep being answered by the other.
            replicas[0].stop()
            for i in range(4):
                assert ask(i) == answers[0]
    finally:
        for replica in replicas:
            replica.stop()


async def _published_addresses(redis_url: str) -> set[str]:
    import redis.asyncio as aioredis

    from services.scheduler.load_reporter import read_engine_loads

    client = aioredis.from_url(redis_url)
    try:
        return {entry["address"] for entry in (await read_engine_loads(client)).values()}
    finally:
        await client.aclose()
