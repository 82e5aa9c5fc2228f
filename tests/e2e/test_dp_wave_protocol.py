"""The DP wave protocol's engine and coordinator objects (services/scheduler/dp_wave.py) over a
real redis-server, each engine driven by the real lockstep StepLoop: its core and ranks are
stand-ins (a count of tokens to generate; an in-process all-reduce as the MoE exchange), so a
group of two steps, pauses and restarts in milliseconds. Checked here:

- a captured FIRST_REQ / START_DP_WAVE sent again is dropped and counted (replayed), and neither
  restarts the paused group nor moves its wave; a message stamped outside the allowed skew is
  dropped and counted (stale); the message format and its freshness check on their own;
- a request carrying an old wave at a paused engine starts the group's current wave, one carrying
  a newer wave moves the engine (and with its ask the coordinator) forward;
- the first START_DP_WAVE lost on its way to one engine: the request still finishes in about a
  second (the waiting engine asks again, the coordinator sends START_DP_WAVE again).
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis

from services.common.dp_wave import (
    FIRST_REQ,
    MESSAGE_SKEW_S,
    NONCE_BYTES,
    START_DP_WAVE,
    MessageGuard,
    ReplayedMessage,
    StaleMessage,
    check_request_wave,
    coordinator_channel,
    decode_message,
    encode_message,
    engines_channel,
    parse_wave_entry,
    wave_key,
)
from services.common.proto import myvllm_pb2 as pb
from services.common.redis_registry import BadEntry, sign_entry
from services.engine.step_loop import StepLoop
from services.gateway.dp_waves import GroupWaves
from services.scheduler.dp_wave import ASK_AGAIN_S, EngineWave, WaveCoordinator

TOKEN = "dp-wave-protocol-token"
GROUP = "g"
SIZE = 2


# ---------------------------------------------------------------- messages on their own

def test_messages_carry_a_signed_timestamp_and_nonce() -> None:
    channel = coordinator_channel(GROUP)
    text = encode_message(channel, {"type": FIRST_REQ, "engine": 1, "wave": 3}, TOKEN)
    message = decode_message(channel, text, TOKEN, SIZE)
    assert abs(message["ts"] - time.time()) < 1 and len(message["nonce"]) == 2 * NONCE_BYTES
    assert decode_message(channel, encode_message(channel, {"type": FIRST_REQ, "engine": 1, "wave": 3}, TOKEN),
                          TOKEN, SIZE)["nonce"] != message["nonce"]
    for field, value in (("ts", message["ts"] + 1), ("nonce", "0" * 2 * NONCE_BYTES)):
        with pytest.raises(BadEntry, match="MAC"):  # both under the MAC: a replayer cannot refresh them
            decode_message(channel, json.dumps({**json.loads(text), field: value}), TOKEN, SIZE)
    for field, value, why in (("ts", None, "ts is not a time"), ("ts", "now", "ts is not a time"),
                              ("nonce", None, "nonce is not a nonce"), ("nonce", "xyz", "nonce is not a nonce")):
        unsigned = {**json.loads(encode_message(channel, {"type": FIRST_REQ, "engine": 1, "wave": 3}, None)),
                    field: value}
        with pytest.raises(BadEntry, match=why):
            decode_message(channel, json.dumps(unsigned), None, SIZE)


def test_the_guard_drops_replays_and_stale_messages_and_forgets_with_the_window() -> None:
    guard = MessageGuard(skew_s=5.0, max_seen=3)
    now = 1000.0
    first = {"ts": now, "nonce": "a"}
    guard.admit(first, now)
    with pytest.raises(ReplayedMessage):
        guard.admit(first, now + 4.0)
    for ts in (now - 5.5, now + 5.5):
        with pytest.raises(StaleMessage):
            guard.admit({"ts": ts, "nonce": f"s{ts}"}, now)
    assert (guard.num_replayed, guard.num_stale) == (1, 2)
    # Once the message would be stale anyway, its nonce is forgotten (the seen-set stays bounded).
    with pytest.raises(StaleMessage):
        guard.admit(first, now + 10.5)
    assert len(guard._seen) == 0
    for i in range(5):
        guard.admit({"ts": now + 20, "nonce": f"n{i}"}, now + 20)
    assert len(guard._seen) == 3


@pytest.mark.parametrize("wave", [-1, 2**62])
def test_a_request_wave_outside_the_counts_is_refused_by_name(wave: int) -> None:
    with pytest.raises(ValueError, match="dp_wave"):
        check_request_wave(wave)
    check_request_wave(0)


# ---------------------------------------------------------------- a group of two over real redis

class _Core:
    """What the lockstep StepLoop needs of an EngineCore: requests are a count of tokens left."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(steps_in_flight=1, expert_parallel_group=True)
        self.tokens_left = 0
        self.num_steps = 0
        self.num_dummy_steps = 0

    def has_unfinished_requests(self) -> bool:
        return self.tokens_left > 0

    def schedule(self) -> pb.SchedulerOutput:
        return pb.SchedulerOutput(num_scheduled_tokens=[1] if self.tokens_left else [])

    def process(self, so: pb.SchedulerOutput, answer: pb.ModelRunnerOutput) -> list:
        self.tokens_left -= 1
        self.num_steps += 1
        return []

    def take_failed_outputs(self) -> list:
        return []


class _Exchange:
    """The group's all-reduce of "anything unfinished": a step ends once every engine is in it."""

    def __init__(self) -> None:
        self._round: tuple[list[bool], asyncio.Future] | None = None

    async def all_reduce(self, flag: bool) -> bool:
        if self._round is None:
            self._round = ([], asyncio.get_running_loop().create_future())
        flags, done = self._round
        flags.append(flag)
        if len(flags) == SIZE:
            self._round = None
            done.set_result(any(flags))
        return await done


class _Ranks:
    def __init__(self, exchange: _Exchange) -> None:
        self.exchange, self.flag = exchange, False

    async def submit(self, so: pb.SchedulerOutput) -> None:
        self.flag = so.dp_local_unfinished

    async def collect(self) -> pb.ModelRunnerOutput:
        return pb.ModelRunnerOutput(dp_global_unfinished=await self.exchange.all_reduce(self.flag))


class _Engine:
    def __init__(self, wave: EngineWave, core: _Core, steps: StepLoop) -> None:
        self.wave, self.core, self.steps = wave, core, steps
        self.work = asyncio.Event()
        wave.wake = self.work.set
        self.task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:  # the scheduler servicer's engine loop, less the worker probes
        while True:
            await self.steps.run_while_busy()
            self.work.clear()
            await self.work.wait()

    def add(self, tokens: int, dp_wave: int) -> None:
        self.wave.note_request(dp_wave)  # (as the scheduler servicer: before the engine holds it)
        self.core.tokens_left += tokens
        self.work.set()


class _Group:
    def __init__(self, url: str, name: str) -> None:
        self.url, self.name = url, name  # (a name per test: the redis-server is the session's)
        self.clients: list = []
        self.engines: list[_Engine] = []

    async def __aenter__(self) -> _Group:
        exchange = _Exchange()
        for rank in range(SIZE):
            client = aioredis.from_url(self.url)
            self.clients.append(client)
            coordinator = WaveCoordinator(client, self.name, SIZE, TOKEN) if rank == 0 else None
            wave = EngineWave(client, self.name, rank, SIZE, TOKEN, coordinator, wake=lambda: None)
            await wave.start()
            core = _Core()
            steps = StepLoop(core, _Ranks(exchange), emit=lambda outputs: None)
            wave.attach(steps)
            self.engines.append(_Engine(wave, core, steps))
        return self

    async def __aexit__(self, *exc) -> None:
        for engine in self.engines:
            engine.task.cancel()
            await engine.wave.close()
        for client in self.clients:
            await client.aclose()

    @property
    def coordinator(self) -> WaveCoordinator:
        return self.engines[0].wave.coordinator

    async def hash(self) -> tuple[int, bool]:
        return parse_wave_entry(await self.clients[0].hgetall(wave_key(self.name)), TOKEN, self.name)

    async def until_paused_at(self, wave: int, timeout: float = 10.0) -> float:
        """Seconds until every engine and the wave hash say: paused, `wave` next."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if await self.hash() == (wave, False) and all(
                    (e.wave.wave, e.wave.running, e.core.tokens_left) == (wave, False, 0) for e in self.engines):
                return time.monotonic() - started
            await asyncio.sleep(0.01)
        raise AssertionError(f"the group did not pause at wave {wave}: hash {await self.hash()}, engines "
                             f"{[(e.wave.wave, e.wave.running, e.core.tokens_left) for e in self.engines]}")

    def dummy_steps(self) -> list[int]:
        return [e.core.num_dummy_steps for e in self.engines]


async def _captured(pubsub) -> list[bytes]:
    raw, deadline = [], time.monotonic() + 0.5
    while time.monotonic() < deadline:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if message is not None:
            raw.append(message["data"])
    return raw


def test_a_replayed_or_stale_message_neither_restarts_the_group_nor_moves_its_wave(redis_server: str) -> None:
    async def main() -> None:
        async with _Group(redis_server, "replayed") as group:
            spy = aioredis.from_url(redis_server)
            pubsub = spy.pubsub()
            await pubsub.subscribe(coordinator_channel(group.name), engines_channel(group.name))
            gateway = GroupWaves(spy, TOKEN)
            await gateway.refresh({group.name})
            wave = gateway.before_send(group.name, 1)  # FIRST_REQ, as a gateway sends it to a paused group
            group.engines[1].add(4, wave)
            await group.until_paused_at(wave + 1)
            captured = await _captured(pubsub)
            kinds = [json.loads(raw)["type"] for raw in captured]
            assert FIRST_REQ in kinds and START_DP_WAVE in kinds, kinds
            assert group.dummy_steps()[0] >= 4
            started, dummies = group.coordinator.num_waves_started, group.dummy_steps()

            for raw in captured:  # every message sent again, verbatim
                to_engines = json.loads(raw)["type"] == START_DP_WAVE
                await spy.publish(engines_channel(group.name) if to_engines else coordinator_channel(group.name), raw)
            channel = coordinator_channel(group.name)  # a FIRST_REQ signed with the token but sent long ago
            first = json.loads(captured[kinds.index(FIRST_REQ)])
            old = sign_entry({**first, "ts": time.time() - 10 * MESSAGE_SKEW_S}, channel, TOKEN)
            await spy.publish(channel, json.dumps(old))
            await asyncio.sleep(1.0)

            to_coordinator = len(kinds) - kinds.count(START_DP_WAVE)  # FIRST_REQ, and engine 1's START_WAVE
            assert group.coordinator.guard.num_replayed == to_coordinator
            assert group.coordinator.guard.num_stale == 1
            assert group.engines[1].wave.num_replayed_messages == kinds.count(START_DP_WAVE)
            assert group.engines[0].wave.num_replayed_messages == kinds.count(START_DP_WAVE) + to_coordinator
            assert group.engines[0].wave.num_stale_messages == 1  # the coordinator's, reported by rank 0
            assert group.coordinator.num_waves_started == started
            assert group.dummy_steps() == dummies
            assert group.coordinator.current_wave == wave + 1
            assert await group.hash() == (wave + 1, False)
            await pubsub.aclose()
            await spy.aclose()

    asyncio.run(main())


def test_a_request_with_an_old_wave_starts_the_current_one_and_a_newer_wave_is_taken(redis_server: str) -> None:
    async def main() -> None:
        async with _Group(redis_server, "request-waves") as group:
            group.engines[0].add(3, 0)
            await group.until_paused_at(1)
            group.engines[1].add(3, 0)  # its sender missed wave 0's end and sent no FIRST_REQ
            await group.until_paused_at(2)
            assert group.engines[0].core.num_dummy_steps >= 3

            group.engines[1].add(3, 7)  # the sender saw wave 7: this engine missed waves' ends
            assert group.engines[1].wave.wave == 7
            await group.until_paused_at(8)
            assert group.coordinator.current_wave == 8

    asyncio.run(main())


def test_a_lost_start_dp_wave_is_recovered_by_the_ask_within_seconds(redis_server: str) -> None:
    async def main() -> None:
        async with _Group(redis_server, "lost-start") as group:
            dropped = []
            subscription = group.engines[1].wave._subscription
            deliver = subscription.handle

            def lose_the_first(message: dict) -> None:
                if message["type"] == START_DP_WAVE and not dropped:
                    dropped.append(message)
                    return
                deliver(message)

            subscription.handle = lose_the_first
            spy = aioredis.from_url(redis_server)
            gateway = GroupWaves(spy, TOKEN)
            await gateway.refresh({group.name})
            started = time.monotonic()
            wave = gateway.before_send(group.name, 0)
            group.engines[0].add(5, wave)
            await group.until_paused_at(wave + 1)
            took = time.monotonic() - started
            await spy.aclose()
            assert dropped and dropped[0]["wave"] == wave
            assert group.coordinator.num_start_resends >= 1
            assert group.engines[1].core.num_dummy_steps >= 5
            assert took < 2 * ASK_AGAIN_S + 0.5, f"recovered in {took:.2f}s"

    asyncio.run(main())


def test_a_gateway_does_not_take_an_older_wave_hash_written_back(redis_server: str) -> None:
    from services.common.dp_wave import wave_entry

    async def main() -> None:
        client = aioredis.from_url(redis_server)
        name = "written-back"
        old = wave_entry(3, False, TOKEN, name)
        await client.hset(wave_key(name), mapping=wave_entry(5, True, TOKEN, name))
        gateway = GroupWaves(client, TOKEN)
        await gateway.refresh({name})
        assert gateway.state[name] == (5, True)
        await client.hset(wave_key(name), mapping=old)  # signed, but from an earlier wave
        await gateway.refresh({name})
        assert gateway.state[name] == (5, True)
        await client.hset(wave_key(name), mapping=wave_entry(6, False, TOKEN, name))
        await gateway.refresh({name})
        assert gateway.state[name] == (6, False)
        await client.aclose()

    asyncio.run(main())
