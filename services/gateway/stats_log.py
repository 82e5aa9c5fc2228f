"""The periodic engine stats line, as vLLM's LoggingStatLogger writes it, one per replica:

    Engine 000: Avg prompt throughput: 12.3 tokens/s, Avg generation throughput: 45.6 tokens/s,
    Running: 2 reqs, Waiting: 0 reqs, GPU KV cache usage: 1.2%, Prefix cache hit rate: 34.5%

(one line; "GPU" even on CPU: vLLM's wording, which log parsers look for). INFO while there was
activity (either throughput, this interval's or the last one's, is nonzero), DEBUG otherwise, so
an idle server stays quiet. The figures are the schedulers' `Stats`, the ones /metrics serves:
throughputs are the token counters' growth over the interval. The prefix cache hit rate is over
the replica's lifetime (vLLM's is over its last 1000 requests; our counters are per token only).
Off with --disable-log-stats; every 10 s, or $MYVLLM_LOG_STATS_INTERVAL seconds.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable

from services.common.proto import myvllm_pb2 as pb

logger = logging.getLogger(__name__)

DEFAULT_LOG_STATS_INTERVAL_S = 10.0  # vLLM's
LOG_STATS_INTERVAL_ENV = "MYVLLM_LOG_STATS_INTERVAL"


def log_stats_interval() -> float:
    """Seconds between two stats lines: $MYVLLM_LOG_STATS_INTERVAL, else vLLM's 10."""
    value = os.environ.get(LOG_STATS_INTERVAL_ENV)
    try:
        return float(value) if value and float(value) > 0 else DEFAULT_LOG_STATS_INTERVAL_S
    except ValueError:
        return DEFAULT_LOG_STATS_INTERVAL_S


def format_stats_line(engine_index: int, prompt_throughput: float, generation_throughput: float,
                      stats: pb.Stats) -> str:
    """vLLM's line, word for word."""
    hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
    return (f"Engine {engine_index:03d}: Avg prompt throughput: {prompt_throughput:.1f} tokens/s, "
            f"Avg generation throughput: {generation_throughput:.1f} tokens/s, Running: {stats.num_running} reqs, "
            f"Waiting: {stats.num_waiting} reqs, GPU KV cache usage: {stats.kv_cache_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {hit_rate * 100:.1f}%")


class EngineStatLogger:
    """One replica's stats line: its token counters at the last line, and that line's throughputs."""

    def __init__(self, engine_index: int, since: float | None = None) -> None:
        """`since`: when counting started (the gateway's start): a replica first read with tokens
        already counted gets a line for them at once (a request answered before the first
        reading would otherwise never show); None: the first reading is only a starting point."""
        self.engine_index = engine_index
        # (time, prompt tokens, generation tokens) at the last reading
        self.last: tuple[float, int, int] | None = None if since is None else (since, 0, 0)
        self.last_throughputs = (0.0, 0.0)

    def line(self, stats: pb.Stats, now: float) -> tuple[int, str] | None:
        """(level, text) of the line for `stats` read at `now`; None for the first reading without
        a `since` (it only sets the counters' starting point: they count from the scheduler's start)."""
        last, self.last = self.last, (now, stats.prompt_tokens, stats.generation_tokens)
        if last is None:
            return None
        last_time, last_prompt, last_generation = last
        elapsed = now - last_time
        throughputs = (_rate(stats.prompt_tokens, last_prompt, elapsed),
                       _rate(stats.generation_tokens, last_generation, elapsed))
        active = any(throughputs) or any(self.last_throughputs)
        self.last_throughputs = throughputs
        return (logging.INFO if active else logging.DEBUG), format_stats_line(self.engine_index, *throughputs, stats)


def _rate(count: int, last_count: int, elapsed: float) -> float:
    """Tokens per second since the last reading; a counter that went down (its scheduler
    restarted) counts from zero."""
    if elapsed <= 0:
        return 0.0
    grown = count - last_count if count >= last_count else count
    return grown / elapsed


class StatsLog:
    """The stats lines of every replica: an engine index per replica address, in the order they
    were first seen (Engine 000, 001, ...)."""

    def __init__(self, since: float | None = None) -> None:
        self.engines: dict[str, EngineStatLogger] = {}
        self.since = since  # see EngineStatLogger

    def lines(self, replica_stats: dict[str, pb.Stats], now: float) -> list[tuple[int, str]]:
        out = []
        for address, stats in replica_stats.items():
            engine = self.engines.setdefault(address, EngineStatLogger(len(self.engines), self.since))
            line = engine.line(stats, now)
            if line is not None:
                out.append(line)
        return out


async def log_stats_forever(read_stats: Callable[[], Awaitable[dict[str, pb.Stats]]], interval_s: float,
                            clock: Callable[[], float] = time.monotonic) -> None:
    """Every `interval_s`: read each replica's stats (`read_stats`, the router's) and log their
    lines. Runs until cancelled."""
    stats_log = StatsLog(since=clock())
    while True:
        for level, text in stats_log.lines(await read_stats(), clock()):
            logger.log(level, text)
        await asyncio.sleep(interval_s)
