"""Data-parallel routing in the gateway.

Unit tests of `ReplicaRouter.pick` (scores, bursts between load updates, replicas going
down), then the real thing: two engine replicas (worker + scheduler processes) publishing
their signed load to a real redis-server that wants a password, a gateway that only knows
Redis, the official openai client; requests spread over both replicas, and when one replica
dies the other serves. Entries forged in Redis meanwhile (unsigned, or a real replica's MAC
on another address) point at a listener of the test's: the gateway never connects to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.processes import free_port, start_redis, stop_process
from support.replica import Replica

from services.client.grpc_client import SchedulerUnavailable
from services.common.proto import myvllm_pb2 as pb
from services.gateway.migration import MigrationPolicy, ResumableRequest, _find_replica, group_ready
from services.gateway.options import GatewayOptions
from services.gateway.router import REDIS_MAX_AGE_S, REFRESH_INTERVAL_S, ReplicaRouter
from services.gateway.server import BackgroundGateway

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


def test_a_migrating_request_waits_until_its_expert_parallel_group_is_whole_again() -> None:
    """After a rank of a group dies, its sibling engine still says ready until its own step fails;
    after the group's restart, one engine is ready before the other: neither is whole yet, and a
    request sent there would fail again (spending a migration) or wait on its group."""

    class HealthClient:
        def __init__(self) -> None:
            self.ready = False

        async def connect(self) -> None:
            pass

        async def health(self) -> bool:
            return self.ready

    router = _router("g:0", "g:1")
    for rank, replica in enumerate(router.replicas.values()):
        replica.client, replica.dp_group, replica.dp_rank = HealthClient(), "default", rank
    g0, g1 = router.replicas["g:0"], router.replicas["g:1"]
    g0.client.ready = True  # the sibling that has not noticed yet (g:1 lost its worker)
    assert not asyncio.run(group_ready(router, g0))
    request = ResumableRequest("r", [1, 2, 3], pb.SamplingParams())
    policy = MigrationPolicy(poll_interval_s=0.01, max_poll_interval_s=0.01)

    async def find_when_g1_is_back() -> str:
        async def back_later() -> None:
            await asyncio.sleep(0.2)
            g1.client.ready = True
        back = asyncio.create_task(back_later())
        found = await _find_replica(router, request, {"g:1"}, time.monotonic() + 5, policy, RuntimeError("lost"))
        assert back.done()  # (nothing was chosen while g:1 was down)
        return found.address

    assert asyncio.run(find_when_g1_is_back()) == "g:0"
    router.replicas["g:0"].dp_group = None  # an engine of no group needs only itself
    g1.client.ready = False
    assert asyncio.run(group_ready(router, g0))


def test_a_replica_missing_from_redis_is_kept_for_a_grace_period(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Redis that comes back empty must not cut off live replicas before they publish again."""
    import services.common.redis_registry as redis_registry

    address = f"127.0.0.1:{free_port()}"  # nobody listens: direct polls fail
    published: dict[str, dict] = {"e1": {"address": address, "num_waiting": 0, "num_running": 1, "ts": time.time()}}

    redis_down = False

    async def fake_read(client: object, max_age_s: float = 10.0, **_: object) -> dict[str, dict]:
        if redis_down:
            raise ConnectionError("Redis is gone")
        return dict(published)

    monkeypatch.setattr(redis_registry, "read_engine_loads", fake_read)

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
            # Redis down for longer than the grace period, then back empty: the first good read
            # restarts the grace instead of dropping every replica at once.
            published["e1"] = {"address": address, "num_waiting": 0, "num_running": 1, "ts": time.time()}
            await router.refresh()
            assert list(router.replicas) == [address]
            nonlocal redis_down
            redis_down = True
            await router.refresh()
            router.replicas[address].last_published -= REDIS_MAX_AGE_S + 1
            redis_down = False
            published.clear()
            await router.refresh()
            assert list(router.replicas) == [address]
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


TOKEN = "dp-routing-internal-token"
REDIS_PASSWORD = "dp-routing-redis-password"


class Listener:
    """A plain TCP listener on loopback that counts the connections it is offered."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


class Forger:
    """What someone who can write to Redis but holds no token would try, kept fresh every
    0.3 s: an unsigned entry, and the newest real replica's entry (MAC and all) re-addressed,
    both pointing at `target`; and an entry that is not even JSON."""

    def __init__(self, redis_url: str, target: str) -> None:
        import redis

        self.client = redis.Redis.from_url(redis_url)
        self.target = target
        self._stop = threading.Event()
        self.forge()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def forge(self) -> None:
        from services.common.redis_registry import ENGINES_KEY

        entries = {k.decode(): json.loads(v) for k, v in self.client.hgetall(ENGINES_KEY).items()
                   if k.decode().startswith("127.0.0.1:")}  # the real replicas (engine id = address)
        forged = {"forged-unsigned": {"address": self.target, "num_waiting": 0, "num_running": 0,
                                      "kv_cache_usage": 0.0, "ts": time.time()},
                  "forged-garbage": "not json {"}
        if entries:
            newest = max(entries.values(), key=lambda e: e["ts"])
            forged["forged-replayed-mac"] = {**newest, "address": self.target}
        self.client.hset(ENGINES_KEY, mapping={k: v if isinstance(v, str) else json.dumps(v)
                                               for k, v in forged.items()})

    def _run(self) -> None:
        while not self._stop.wait(0.3):
            with contextlib.suppress(Exception):
                self.forge()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.client.close()


def test_gateway_routes_over_signed_replicas_found_in_redis_and_never_dials_a_forged_one(
        smollm2_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    import openai
    import redis

    port = free_port()
    redis_proc = start_redis(port, REDIS_PASSWORD)
    redis_url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{port}/0"
    with pytest.raises(redis.exceptions.AuthenticationError):  # no password, no Redis
        redis.Redis(host="127.0.0.1", port=port).hgetall("myvllm:engines")
    listener = Listener()
    replicas: list[Replica] = []
    forger = None
    caplog.set_level(logging.WARNING, logger="services.gateway.router")
    try:
        for _ in range(2):
            replicas.append(Replica(smollm2_dir, redis_url, token=TOKEN))
        for replica in replicas:
            replica.wait_ready()
        forger = Forger(redis_url, listener.address)
        # The gateway is told only where Redis is.
        options = GatewayOptions(internal_token=TOKEN)
        with BackgroundGateway("", smollm2_dir, redis_url=redis_url, options=options) as gateway:
            router = gateway.app.state.ctx.router
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0, timeout=120)
            deadline = time.monotonic() + 30
            while True:  # both replicas discovered (the router reads Redis every 0.25 s)
                known = asyncio.run(_published_addresses(redis_url, TOKEN))
                if known == {r.address for r in replicas} and set(router.replicas) == known:
                    break
                assert time.monotonic() < deadline, f"replicas never published their load: {known}"
                time.sleep(0.25)
            forger.forge()  # the re-addressed MAC is now a real replica's fresh one
            time.sleep(4 * REFRESH_INTERVAL_S)  # and the gateway's router has read it

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

            # The forged entries were there all along, fresh, and never became replicas.
            assert listener.address not in router.replicas
            refused = [r.getMessage() for r in caplog.records if "ignoring redis entry" in r.getMessage()]
            for engine_id in ("forged-unsigned", "forged-replayed-mac", "forged-garbage"):
                assert sum(f"'{engine_id}'" in m for m in refused) == 1, refused  # once, not every refresh
        assert listener.connections == 0, "the gateway dialled a forged replica"
    finally:
        if forger is not None:
            forger.close()
        for replica in replicas:
            replica.stop()
        listener.close()
        stop_process(redis_proc)


async def _published_addresses(redis_url: str, token: str | None = None) -> set[str]:
    import redis.asyncio as aioredis

    from services.common.redis_registry import read_engine_loads

    client = aioredis.from_url(redis_url)
    try:
        return {entry["address"] for entry in (await read_engine_loads(client, token=token)).values()}
    finally:
        await client.aclose()
