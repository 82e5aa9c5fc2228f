"""Publishes this engine replica's load to Redis for the gateways' DP routing.

Redis hash `myvllm:engines`: field = engine id, value = JSON {address, num_waiting, num_running,
kv_cache_usage, prefill_tokens_per_s, step_s, ts, mac} (plus dp_group, dp_rank for an engine of
a data-parallel expert-parallel group: services/common/dp_wave.py), `mac` signing the rest with
the internal token when there is one (services/common/redis_registry.py: gateways with a token
route only to entries whose MAC checks out). Writes are throttled and never awaited by the
engine loop: a slow or absent Redis must not slow down a step. A change is published at once,
unless the last write was under `min_interval_s` ago or is still on the wire: then the latest
load goes out as soon as that allows (a trailing write), so no change waits for the next step or
heartbeat. The measured pace (prefill_tokens_per_s, step_s: 0 until measured) rides along with
each write without triggering one: it changes every step, and a once-a-second refresh is recent
enough for routing. A replica that loses its worker deletes its entry (`leave`) so gateways stop
routing to it, and publishes again once the worker is back (`rejoin`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import redis.asyncio as aioredis

from services.common.proto import myvllm_pb2 as pb
from services.common.redis_registry import ENGINES_KEY, sign_entry

logger = logging.getLogger("myvllm.scheduler")


def _load_key(load: pb.Load) -> tuple[int, int, float]:
    return load.num_waiting, load.num_running, round(load.kv_cache_usage, 3)


class LoadReporter:
    def __init__(self, redis_url: str, engine_id: str, address: str, min_interval_s: float = 0.1,
                 token: str | None = None, extra: dict | None = None) -> None:
        self.client = aioredis.from_url(redis_url)
        self.extra = extra or {}  # fields every entry carries (a lockstep group's engine: dp_group, dp_rank)
        self.engine_id = engine_id
        self.address = address
        self.token = token  # signs every entry (None: unsigned)
        self.min_interval_s = min_interval_s
        self._last_sent = 0.0
        self._last_load: tuple | None = None
        self._in_flight: asyncio.Task | None = None
        self._trailing: asyncio.TimerHandle | None = None  # a held-back change's write, scheduled
        self._held: pb.Load | None = None                   # the latest load held back
        # While the replica cannot serve (no worker) it is out of the set: no entry, no reports.
        self.paused = False

    def report(self, load: pb.Load) -> None:
        if self.paused:
            return
        key = _load_key(load)
        now = time.monotonic()
        if key == self._last_load and now - self._last_sent < 1.0:
            self._held = None  # back to what readers have: nothing to catch up on
            return  # unchanged: refresh about once a second so readers see a live timestamp
        busy = self._in_flight is not None and not self._in_flight.done()
        wait = self.min_interval_s - (now - self._last_sent)
        if busy or (wait > 0 and key != (0, 0, 0.0)):
            self._held = load
            if self._trailing is None:
                self._trailing = asyncio.get_running_loop().call_later(max(wait, 0.01), self._send_held)
            return
        self._held = None
        self._last_sent, self._last_load = now, key
        self._in_flight = asyncio.create_task(self._send(load))

    def _send_held(self) -> None:
        self._trailing = None
        load, self._held = self._held, None
        if load is not None:
            self.report(load)  # (re-checks pause, interval and the write on the wire)

    async def _send(self, load: pb.Load) -> None:
        num_waiting, num_running, kv_cache_usage = _load_key(load)
        entry = {**self.extra, "address": self.address, "num_waiting": num_waiting, "num_running": num_running,
                 "kv_cache_usage": kv_cache_usage, "prefill_tokens_per_s": round(load.prefill_tokens_per_s, 1),
                 "step_s": round(load.step_s, 6), "ts": time.time()}
        value = json.dumps(sign_entry(entry, self.engine_id, self.token))
        try:
            await self.client.hset(ENGINES_KEY, self.engine_id, value)
        except Exception as e:  # Redis down: routing degrades, serving goes on
            logger.warning("cannot publish load to redis: %s", e)

    async def _delete(self) -> None:
        try:
            await self.client.hdel(ENGINES_KEY, self.engine_id)
        except Exception as e:
            logger.warning("cannot remove this replica from redis: %s", e)

    def _then(self, write) -> None:
        """Run `write` after the write on the wire, so the two reach Redis in order."""
        previous = self._in_flight

        async def in_order() -> None:
            if previous is not None:
                await asyncio.wait([previous])
            await write()

        self._in_flight = asyncio.create_task(in_order())

    def leave(self) -> None:
        """Take this replica out of the set gateways route to (its worker is gone)."""
        self.paused = True
        self._then(self._delete)

    def rejoin(self, load: pb.Load) -> None:
        """Back in the set: publish at once."""
        self.paused = False
        self._last_sent, self._last_load = time.monotonic(), _load_key(load)
        self._then(lambda: self._send(load))
