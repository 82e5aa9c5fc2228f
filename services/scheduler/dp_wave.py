"""The DP wave protocol on the scheduler's side: one engine's part (`EngineWave`, every engine of
a data-parallel expert-parallel group) and the coordinator's (`WaveCoordinator`, in DP rank 0's
scheduler). The Redis contract (keys, channels, messages) is services/common/dp_wave.py.

An engine steps while the group's wave runs and pauses with the others when no engine has work
(services/engine/step_loop.py decides both, from the ranks' all-reduce). Paused, it waits for
START_DP_WAVE. An engine that holds work while paused (a request came in, perhaps carrying an
older wave than the engine's, or arrived as the wave ended) starts stepping at once and asks
the coordinator to start the group (START_WAVE; its steps wait in the MoE exchanges until the
others join). An engine whose steps wait so (holding work while paused, or started by
START_DP_WAVE with no step done since) asks again every second. The coordinator starts a wave
only while paused (a request for the next wave that arrives while the current one ends is kept
and honoured as it ends); asked for the wave it believes running, it sends START_DP_WAVE again
(engines already stepping ignore it), so a START_DP_WAVE lost on the way to one engine costs
about a second, not an engine timeout and a group restart. DP rank 0 tells it when the wave
ended, and the wave number advances; no message moves it back.

A request carries the wave its sender last read (vLLM's `request.current_wave`): at a paused
engine, an older one means the sender missed the wave's end and sent no FIRST_REQ (the engine's
ask starts the engine's current wave); a newer one means this engine missed a wave's end or
start, and it takes that number.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

from services.common.dp_wave import (
    FIRST_REQ,
    START_DP_WAVE,
    START_WAVE,
    MessageGuard,
    coordinator_channel,
    decode_message,
    encode_message,
    engines_channel,
    parse_wave_entry,
    wave_entry,
    wave_key,
)
from services.common.redis_registry import BadEntry

logger = logging.getLogger("myvllm.scheduler")

RESUBSCRIBE_BACKOFF_S = 0.5
MAX_RESUBSCRIBE_BACKOFF_S = 5.0
ASK_AGAIN_S = 1.0
# The coordinator sends START_DP_WAVE for a running wave again at most this often: an ask that
# crossed the first one on the way needs no second.
RESEND_AFTER_S = 0.5


class _Subscription:
    """Calls `handle` with every valid message on `channel` (signed if there is a token, fresh,
    not seen before: `guard` counts those it drops); survives Redis restarts (subscribes again,
    then calls `on_resubscribed`, since messages published meanwhile are lost)."""

    def __init__(self, client, channel: str, token: str | None, num_engines: int,
                 handle: Callable[[dict], None], on_resubscribed: Callable[[], None] = lambda: None) -> None:
        self.client, self.channel, self.token, self.num_engines = client, channel, token, num_engines
        self.handle, self.on_resubscribed = handle, on_resubscribed
        self.guard = MessageGuard()
        self.task: asyncio.Task | None = None
        self._pubsub = None

    async def start(self) -> None:
        """Subscribed when this returns (a message published after it is seen)."""
        self._pubsub = self.client.pubsub()
        await self._pubsub.subscribe(self.channel)
        self.task = asyncio.create_task(self._run(), name=f"myvllm-sub-{self.channel}")

    async def _run(self) -> None:
        backoff = RESUBSCRIBE_BACKOFF_S
        while True:
            try:
                if self._pubsub is None:
                    self._pubsub = self.client.pubsub()
                    await self._pubsub.subscribe(self.channel)
                    logger.info("subscribed to %s again", self.channel)
                    self.on_resubscribed()
                    backoff = RESUBSCRIBE_BACKOFF_S
                message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if message is not None and message.get("type") == "message":
                    self._dispatch(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis went away: subscribe again once it is back
                logger.warning("redis subscription %s lost (%s); retrying in %.1fs", self.channel, e, backoff)
                with contextlib.suppress(Exception):
                    await self._pubsub.aclose()
                self._pubsub = None
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_RESUBSCRIBE_BACKOFF_S)

    def _dispatch(self, raw: bytes) -> None:
        try:
            message = decode_message(self.channel, raw, self.token, self.num_engines)
            self.guard.admit(message)
        except BadEntry as e:
            logger.warning("ignoring a message on %s: %s", self.channel, e)
            return
        self.handle(message)

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()


class _OrderedWrites:
    """Redis writes and publishes, one at a time in the order made, never awaited by the caller
    (a slow Redis must not stall a step); a failed one is logged and the next goes on."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.create_task(self._run(), name="myvllm-wave-writes")

    def put(self, write: Callable[[], object]) -> None:
        self._queue.put_nowait(write)

    async def _run(self) -> None:
        while True:
            write = await self._queue.get()
            try:
                await write()
            except Exception as e:
                logger.warning("redis write for the DP wave failed: %s", e)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class WaveCoordinator:
    """The group's wave state (DP rank 0's scheduler holds it and writes it to Redis)."""

    def __init__(self, client, group: str, num_engines: int, token: str | None) -> None:
        self.client, self.group, self.num_engines, self.token = client, group, num_engines, token
        self.current_wave = 0
        self.engines_running = False
        self._pending_start = -1  # a start asked for the wave after the one still running
        self.num_waves_started = 0
        self.num_start_resends = 0  # START_DP_WAVE sent again for a running wave (one was lost)
        self._last_start_sent = -math.inf  # (monotonic)
        self._writes: _OrderedWrites | None = None
        self._subscription = _Subscription(client, coordinator_channel(group), token, num_engines, self._on_message,
                                           on_resubscribed=self._write_state)

    async def start(self) -> None:
        """Continue from the wave number in Redis (a restarted group must not reuse a number a
        gateway may hold), paused."""
        self._writes = _OrderedWrites()
        try:
            found = parse_wave_entry(await self.client.hgetall(wave_key(self.group)), self.token, self.group)
        except Exception as e:
            logger.warning("cannot read the DP wave from redis (%s): starting at wave 0", e)
            found = None
        if found is not None:
            self.current_wave = found[0] + (1 if found[1] else 0)  # a wave cut short by the restart is over
        self._write_state()
        await self._subscription.start()

    @property
    def guard(self) -> MessageGuard:
        """What the coordinator's channel dropped as stale or replayed."""
        return self._subscription.guard

    def _on_message(self, message: dict) -> None:
        if message["type"] in (FIRST_REQ, START_WAVE):
            self.request_start(message["wave"], message["engine"], message["type"])

    def request_start(self, wave: int, engine: int, why: str = START_WAVE) -> None:
        """Engine `engine` has (or is about to get) work and asks for wave `wave` to run."""
        if self.engines_running:
            if wave > self.current_wave:  # the running wave is ending: start the next one when it has
                self._pending_start = max(self._pending_start, wave)
            elif time.monotonic() - self._last_start_sent >= RESEND_AFTER_S:
                # Asked again for the running wave (or an older one): an engine's steps wait for
                # engines that never heard START_DP_WAVE. Those stepping ignore it.
                logger.info("%s from engine %d while wave %d runs: sending START_DP_WAVE again", why, engine,
                            self.current_wave)
                self.num_start_resends += 1
                self._publish_start(exclude=-1)
            return
        if wave < self.current_wave:
            logger.info("%s from engine %d names wave %d, which has ended: starting wave %d", why, engine, wave,
                        self.current_wave)
        self.current_wave = max(self.current_wave, wave)
        self._start_wave(exclude=engine)

    def wave_complete(self, wave: int) -> None:
        """DP rank 0's engine paused at the end of `wave` (every engine did, at the same step)."""
        if wave != self.current_wave:
            logger.warning("wave %d reported complete while the coordinator is at wave %d", wave, self.current_wave)
        self.current_wave = max(self.current_wave, wave + 1)
        self.engines_running = False
        if self._pending_start >= self.current_wave:
            self._start_wave(exclude=-1)
        else:
            self._write_state()

    def _start_wave(self, exclude: int) -> None:
        self.engines_running = True
        self.num_waves_started += 1
        self._write_state()
        self._publish_start(exclude)

    def _publish_start(self, exclude: int) -> None:
        self._last_start_sent = time.monotonic()
        channel = engines_channel(self.group)
        text = encode_message(channel, {"type": START_DP_WAVE, "wave": self.current_wave, "exclude": exclude},
                              self.token)
        self._writes.put(lambda: self.client.publish(channel, text))

    def _write_state(self) -> None:
        fields = wave_entry(self.current_wave, self.engines_running, self.token, self.group)
        self._writes.put(lambda: self.client.hset(wave_key(self.group), mapping=fields))

    async def close(self) -> None:
        await self._subscription.close()
        if self._writes is not None:
            await self._writes.close()


class EngineWave:
    """One engine's part: its wave number, and the link between its lockstep step loop (whose
    `group_running` says whether the wave runs) and the coordinator."""

    def __init__(self, client, group: str, dp_rank: int, num_engines: int, token: str | None,
                 coordinator: WaveCoordinator | None, wake: Callable[[], None]) -> None:
        self.client, self.group, self.dp_rank, self.num_engines, self.token = client, group, dp_rank, num_engines, token
        self.coordinator = coordinator  # DP rank 0's scheduler holds it
        self.wake = wake  # the engine loop's: a wave started while it waits
        self.wave = 0
        self.steps = None  # the StepLoop (services/engine/step_loop.py), once the engine is built
        self._started_up_to = -1  # the highest wave a START_DP_WAVE named
        self._asking: asyncio.TimerHandle | None = None
        self._steps_at_ask = 0  # the engine's steps when it last asked (or was started)
        self._first_req_sent = False  # a request's sender has asked the coordinator for this engine
        self._writes: _OrderedWrites | None = None
        self._subscription = _Subscription(client, engines_channel(group), token, num_engines, self._on_message,
                                           on_resubscribed=self._catch_up)

    async def start(self) -> None:
        self._writes = _OrderedWrites()
        if self.coordinator is not None:
            await self.coordinator.start()
            self.wave = self.coordinator.current_wave
        else:
            await self._catch_up_now()
        await self._subscription.start()

    @property
    def running(self) -> bool:
        return self.steps is not None and self.steps.group_running

    # ------------------------------------------------------------ from the step loop

    def attach(self, steps) -> None:
        self.steps = steps
        steps.on_group_pause = self.on_group_pause
        steps.on_work_while_paused = self.ask_to_start

    def on_group_pause(self) -> None:
        """Every engine paused after the same step: the wave is over."""
        ended = self.wave
        self.wave += 1
        self._first_req_sent = False  # work left at the pause was sent during the wave: ask at once
        if self.coordinator is not None:
            self.coordinator.wave_complete(ended)
        if self._started_up_to >= self.wave:  # the next wave was started before this one ended here
            self.steps.group_running = True

    def ask_to_start(self) -> None:
        """This engine has work while the group is paused: have the coordinator start it (again
        every second until the group runs). Not at once when the request's sender has asked
        (FIRST_REQ): a second ask could reach the coordinator after that wave ended and start
        another, of dummy steps only."""
        if self._asking is not None:
            return
        if not self._first_req_sent:
            self._ask()
        self._first_req_sent = False
        self._watch()

    def _ask(self) -> None:
        if self.coordinator is not None:
            self.coordinator.request_start(self.wave, self.dp_rank)
        else:
            channel = coordinator_channel(self.group)
            text = encode_message(channel, {"type": START_WAVE, "wave": self.wave, "engine": self.dp_rank}, self.token)
            self._writes.put(lambda: self.client.publish(channel, text))

    def _steps_done(self) -> int:
        return self.steps.core.num_steps + self.steps.core.num_dummy_steps

    def _watch(self) -> None:
        """Check in a second that this engine's steps go on (the group joined them)."""
        if self._asking is not None:
            self._asking.cancel()
        self._steps_at_ask = self._steps_done()
        self._asking = asyncio.get_running_loop().call_later(ASK_AGAIN_S, self._ask_again)

    def _ask_again(self) -> None:
        self._asking = None
        if self.steps is None:
            return
        if self.running:
            waiting = self._steps_done() == self._steps_at_ask  # started, but its first step never ended
        else:
            waiting = self.steps.core.has_unfinished_requests()
        if waiting:
            self._ask()
            self._watch()

    def note_request(self, request_wave: int) -> None:
        """A request is arriving (called before the engine holds it) carrying `request_wave`,
        the wave its sender last read. At a paused engine, a newer one than this engine's means
        this engine missed a wave's end or start: it takes the number (so its ask names the wave
        the group is at); an older one means the sender missed the wave's end and sent no
        FIRST_REQ: the step loop's ask_to_start starts this engine's current wave at once. A
        running engine learns the next number when the wave ends."""
        if self.running:
            return
        if request_wave > self.wave:
            logger.info("a request carries wave %d while this engine is paused at wave %d: taking it", request_wave,
                        self.wave)
            self.wave = request_wave
        elif request_wave < self.wave:
            logger.info("a request carries wave %d, which has ended: starting wave %d", request_wave, self.wave)
        # Carrying the wave this engine is paused at, the sender saw the group paused and sent
        # FIRST_REQ (vLLM's front-end does the same): an engine with no other work asks itself
        # only if no wave starts within ASK_AGAIN_S.
        idle = not (self.steps is not None and self.steps.core.has_unfinished_requests())
        self._first_req_sent = request_wave >= self.wave and (self._first_req_sent or idle)

    @property
    def num_stale_messages(self) -> int:
        """Wave messages dropped for a timestamp outside the window (the coordinator's too, if here)."""
        guards = [self._subscription.guard] + ([self.coordinator.guard] if self.coordinator else [])
        return sum(g.num_stale for g in guards)

    @property
    def num_replayed_messages(self) -> int:
        """Wave messages dropped for a nonce already taken (the coordinator's too, if here)."""
        guards = [self._subscription.guard] + ([self.coordinator.guard] if self.coordinator else [])
        return sum(g.num_replayed for g in guards)

    # ------------------------------------------------------------ from the coordinator

    def _on_message(self, message: dict) -> None:
        self._start(message["wave"])

    def _start(self, wave: int) -> None:
        self._started_up_to = max(self._started_up_to, wave)
        if self.steps is None or self.running or wave < self.wave:
            return  # running: on_group_pause picks it up; older: a wave this engine has finished
        self.wave = wave
        self.steps.group_running = True
        self._first_req_sent = False
        self._watch()  # until its first step ends: the others may not have heard START_DP_WAVE
        self.wake()

    def _catch_up(self) -> None:
        asyncio.get_running_loop().create_task(self._catch_up_now())

    async def _catch_up_now(self) -> None:
        """START_DP_WAVE messages may have been missed (Redis restarted, or before subscribing):
        the wave hash says whether a wave runs."""
        try:
            found = parse_wave_entry(await self.client.hgetall(wave_key(self.group)), self.token, self.group)
        except Exception as e:
            logger.warning("cannot read the DP wave from redis: %s", e)
            return
        if found is None:
            return
        wave, running = found
        if running:
            self._start(wave)
        elif wave > self.wave and not self.running:
            self.wave = wave

    async def close(self) -> None:
        if self._asking is not None:
            self._asking.cancel()
        await self._subscription.close()
        if self._writes is not None:
            await self._writes.close()
        if self.coordinator is not None:
            await self.coordinator.close()
