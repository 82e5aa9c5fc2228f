"""The scheduler's own pace (services/engine/step_pace.py), which it publishes with its load for
the gateway's cache-aware cost: mean step time and prompt tokens per second of step time."""

from __future__ import annotations

import pytest

from services.common.proto import myvllm_pb2 as pb
from services.engine.step_pace import ALPHA, StepPace, prompt_positions


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _step(pace: StepPace, clock: _Clock, step_id: int, prompt_tokens: int, seconds: float) -> None:
    pace.scheduled(step_id, prompt_tokens)
    clock.now += seconds
    pace.processed(step_id)


def test_nothing_is_measured_before_a_step() -> None:
    pace = StepPace(_Clock())
    assert (pace.step_s, pace.prefill_tokens_per_s) == (0.0, 0.0)
    pace.processed(7)  # a step it never saw scheduled (no tokens): nothing to measure
    assert (pace.step_s, pace.prefill_tokens_per_s) == (0.0, 0.0)


def test_prefill_rate_counts_the_time_prompt_tokens_add_over_a_decode_step() -> None:
    clock = _Clock()
    pace = StepPace(clock)
    _step(pace, clock, 1, 0, 0.02)                  # a decode step: 20 ms
    assert pace.step_s == pytest.approx(0.02) and pace.prefill_tokens_per_s == 0.0
    _step(pace, clock, 2, 400, 0.22)                # 400 prompt tokens add 200 ms
    assert pace.prefill_tokens_per_s == pytest.approx(2000)
    assert pace.step_s == pytest.approx((1 - ALPHA) * 0.02 + ALPHA * 0.22)
    # A few uncached tokens after a prefix hit weigh little against the large prefill before.
    _step(pace, clock, 3, 16, 0.03)
    assert pace.prefill_tokens_per_s == pytest.approx(((1 - ALPHA) * 400 + 16) / ((1 - ALPHA) * 0.2 + 0.01))


def test_a_decode_baseline_as_slow_as_the_step_does_not_make_prompt_tokens_free() -> None:
    clock = _Clock()
    pace = StepPace(clock)
    _step(pace, clock, 1, 0, 0.5)
    _step(pace, clock, 2, 100, 0.1)                 # faster than the decode baseline
    assert pace.prefill_tokens_per_s == pytest.approx(100 / 0.01)


def test_a_step_scheduled_while_another_computes_starts_when_that_one_ends() -> None:
    """Async scheduling: step 2 goes out right after step 1; it computes once step 1 is done."""
    clock = _Clock()
    pace = StepPace(clock)
    pace.scheduled(1, 0)
    pace.scheduled(2, 0)
    clock.now += 0.05
    pace.processed(1)
    clock.now += 0.05
    pace.processed(2)
    assert pace.step_s == pytest.approx(0.05)       # not 0.1
    # An idle gap before a step is not part of it either.
    clock.now += 10
    _step(pace, clock, 3, 0, 0.05)
    assert pace.step_s == pytest.approx(0.05)
    # After a worker failure the steps in flight never come back; the averages stay.
    pace.scheduled(4, 100)
    pace.forget_in_flight()
    clock.now += 1
    pace.processed(4)
    assert pace.step_s == pytest.approx(0.05) and pace.prefill_tokens_per_s == 0.0


def test_prompt_positions_leave_out_generated_tokens() -> None:
    # A fresh 40-token prompt; the last 10 of a 100-token prompt and 1 generated; a decode.
    assert prompt_positions([0, 90, 120], [40, 11, 1], [40, 100, 100]) == 40 + 10
    assert prompt_positions([], [], []) == 0


def test_the_engine_publishes_its_pace_with_its_load() -> None:
    from services.common.config import VllmConfig
    from services.engine.engine_core import EngineCore

    core = EngineCore(VllmConfig.from_engine_args(model="unused"),
                      pb.ModelInfo(max_model_len=256, vocab_size=1000, eos_token_ids=[2], device="cpu"), num_blocks=64)
    clock = _Clock()
    core.pace = StepPace(clock)
    try:
        assert (core.load().step_s, core.load().prefill_tokens_per_s) == (0.0, 0.0)
        core.add_request(pb.GenerateRequest(request_id="r", prompt_token_ids=list(range(10, 50)),
                                            sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True)))
        for seconds in (0.5, 0.1):  # the 40-token prefill, then a decode step
            so = core.schedule()
            clock.now += seconds
            core.process(so, pb.ModelRunnerOutput(step_id=so.step_id, request_ids=["r"], sampled_token_ids=[7]))
        load = core.load()
        assert load.step_s == pytest.approx((1 - ALPHA) * 0.5 + ALPHA * 0.1)
        assert load.prefill_tokens_per_s == pytest.approx(40 / 0.5)
    finally:
        core.structured_output.close()
