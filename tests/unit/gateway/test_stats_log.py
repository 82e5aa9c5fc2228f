"""The periodic engine stats line (services/gateway/stats_log.py): vLLM's wording, and its
throughputs as the token counters' growth over the interval, on a fake clock."""

from __future__ import annotations

import asyncio
import itertools
import logging

import pytest

from services.common.proto import myvllm_pb2 as pb
from services.gateway.stats_log import (
    EngineStatLogger,
    StatsLog,
    format_stats_line,
    log_stats_forever,
    log_stats_interval,
)


def stats(prompt: int = 0, generation: int = 0, **fields) -> pb.Stats:
    return pb.Stats(prompt_tokens=prompt, generation_tokens=generation, **fields)


def test_the_line_is_vllms_word_for_word() -> None:
    line = format_stats_line(0, 12.34, 45.6, stats(num_running=2, num_waiting=0, kv_cache_usage=0.012,
                                                   prefix_cache_queries=200, prefix_cache_hits=69))
    assert line == ("Engine 000: Avg prompt throughput: 12.3 tokens/s, Avg generation throughput: 45.6 tokens/s, "
                    "Running: 2 reqs, Waiting: 0 reqs, GPU KV cache usage: 1.2%, Prefix cache hit rate: 34.5%")
    assert format_stats_line(12, 0, 0, stats()).startswith("Engine 012: ")
    assert format_stats_line(0, 0, 0, stats()).endswith("Prefix cache hit rate: 0.0%")  # no query yet


def test_throughput_is_the_counters_delta_over_the_interval() -> None:
    engine = EngineStatLogger(0)
    assert engine.line(stats(prompt=100, generation=7), now=50.0) is None  # the first reading: a starting point
    level, text = engine.line(stats(prompt=350, generation=507, num_running=3), now=60.0)
    assert level == logging.INFO
    assert "Avg prompt throughput: 25.0 tokens/s, Avg generation throughput: 50.0 tokens/s, Running: 3 reqs" in text
    level, text = engine.line(stats(prompt=350, generation=527), now=64.0)  # a shorter interval
    assert "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 5.0 tokens/s" in text


def test_an_idle_engine_logs_at_debug_after_one_quiet_line() -> None:
    engine = EngineStatLogger(0)
    engine.line(stats(prompt=10, generation=10), now=0.0)
    assert engine.line(stats(prompt=20, generation=30), now=10.0)[0] == logging.INFO
    # the first quiet interval still shows (the last one had activity), as vLLM's does
    assert engine.line(stats(prompt=20, generation=30), now=20.0)[0] == logging.INFO
    level, text = engine.line(stats(prompt=20, generation=30), now=30.0)
    assert level == logging.DEBUG and "Avg prompt throughput: 0.0 tokens/s" in text


def test_tokens_counted_before_the_first_reading_show_in_its_line() -> None:
    """A request answered between the gateway's start and its first reading of the replica."""
    engine = EngineStatLogger(0, since=0.0)
    level, text = engine.line(stats(prompt=20, generation=40), now=2.0)
    assert level == logging.INFO
    assert "Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 20.0 tokens/s" in text


def test_a_restarted_scheduler_counts_from_zero() -> None:
    engine = EngineStatLogger(0)
    engine.line(stats(prompt=1000, generation=1000), now=0.0)
    _, text = engine.line(stats(prompt=40, generation=20), now=10.0)
    assert "Avg prompt throughput: 4.0 tokens/s, Avg generation throughput: 2.0 tokens/s" in text


def test_one_line_per_replica_numbered_in_order_of_appearance() -> None:
    stats_log = StatsLog()
    assert stats_log.lines({"a:1": stats(), "b:2": stats()}, now=0.0) == []
    lines = stats_log.lines({"b:2": stats(generation=10), "a:1": stats(), "c:3": stats()}, now=10.0)
    assert [text.split(":")[0] for _, text in lines] == ["Engine 001", "Engine 000"]  # c:3's first reading
    assert "Avg generation throughput: 1.0 tokens/s" in lines[0][1]
    lines = stats_log.lines({"c:3": stats()}, now=20.0)  # a replica that does not answer has no line
    assert [text.split(":")[0] for _, text in lines] == ["Engine 002"]


def test_the_interval_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MYVLLM_LOG_STATS_INTERVAL", raising=False)
    assert log_stats_interval() == 10.0
    monkeypatch.setenv("MYVLLM_LOG_STATS_INTERVAL", "0.5")
    assert log_stats_interval() == 0.5
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv("MYVLLM_LOG_STATS_INTERVAL", bad)
        assert log_stats_interval() == 10.0


def test_the_loop_logs_each_interval(caplog: pytest.LogCaptureFixture) -> None:
    # (then the same reading over and over, 3 s apart: idle lines)
    readings = itertools.chain([stats()], itertools.repeat(stats(prompt=30, generation=60)))
    clock = itertools.count(0.0, 3.0)

    async def read_stats() -> dict[str, pb.Stats]:
        return {"a:1": next(readings)}

    async def run() -> None:
        task = asyncio.create_task(log_stats_forever(read_stats, 0.01, clock=lambda: next(clock)))
        while not any("Engine 000" in r.message for r in caplog.records):
            await asyncio.sleep(0.01)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="services.gateway.stats_log"):
        asyncio.run(asyncio.wait_for(run(), 5))
    record = next(r for r in caplog.records if "Engine 000" in r.message)
    assert record.levelno == logging.INFO
    assert "Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 20.0 tokens/s" in record.message
