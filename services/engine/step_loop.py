"""The engine's one step loop, for the scheduler service and the offline `LLM` alike.

Schedule, submit to the ranks, collect the sampled ids, fold them in, emit the outputs. With
async scheduling two steps are in flight: step N+1 is scheduled and submitted while the ranks
still compute step N. With P pipeline stages P steps are (vLLM's batch queue): stage 0 starts
step N+1 while stage 1 computes step N, each on requests whose earlier tokens are back. A step
whose constrained rows need the grammar bitmask of tokens still in flight is submitted without
it; its bitmask (a follow-up message) goes out once the step before it is processed.

Who the ranks are is the `WorkerHandle`'s business: gRPC streams to worker processes
(services/scheduler/worker_group.py) or workers in this process and its children
(services/offline/local_workers.py). Who the outputs go to is the `emit` callback's.

Lockstep (data-parallel engines whose MoE layers are one expert-parallel group): every engine's
ranks must enter every MoE layer's exchange together, so while the group's wave runs each engine
steps even with nothing to do (a dummy step: the ranks join the exchanges with no tokens). Each
step tells the ranks whether this engine has unfinished requests; they all-reduce it over the
group and answer with the result, so every engine learns after the same step that none has
any, and they all pause there (vLLM's DP wave: docs/design.md, "Waves"). One step in flight.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Protocol

from services.common.proto import myvllm_pb2 as pb
from services.engine.engine_core import EngineCore

# How long the loop waits between steps that only poll the worker's KV transfers (nothing else
# to run): short next to a transfer, long enough not to spin a core the transfer needs.
KV_TRANSFER_POLL_S = 0.002


class WorkerHandle(Protocol):
    """An engine's ranks, as the step loop drives them."""

    async def submit(self, so: pb.SchedulerOutput) -> None:
        """Start a step on every rank, or send the grammar follow-up of the oldest step in flight."""

    async def collect(self) -> pb.ModelRunnerOutput:
        """The oldest submitted step's answer (a step with a follow-up answers once, after it)."""

    async def probe(self) -> None:
        """Raise if the ranks are gone (an idle engine checks now and then)."""

    async def reset(self) -> None:
        """After a failure: forget every step in flight and every request on the ranks."""


class StepLoop:
    """Runs `core`'s steps on `workers`; every step's outputs go to `emit`, then `after_step`
    runs (publishing KV events and load, say)."""

    def __init__(self, core: EngineCore, workers: WorkerHandle,
                 emit: Callable[[list[pb.RequestOutput]], None],
                 after_step: Callable[[], None] | None = None) -> None:
        self.core = core
        self.workers = workers
        self.emit = emit
        self.after_step = after_step or (lambda: None)
        self.depth = core.config.steps_in_flight
        self.lockstep = core.config.expert_parallel_group
        # Lockstep: whether the group's wave runs (this engine steps, dummy steps if need be), and
        # what the wave's owner is told: the group paused; this engine holds work while paused.
        self.group_running = False
        self.on_group_pause: Callable[[], None] = lambda: None
        self.on_work_while_paused: Callable[[], None] = lambda: None

    async def run_while_busy(self) -> int:
        """Run steps until none is in flight and none can be scheduled (nothing to do, or nothing
        that fits right now: a grammar still compiling, blocks an abort will free). Returns how
        many steps ran. Raises whatever a step raised; `fail_all` then makes a clean slate.
        Lockstep: until the group pauses (see the module's docstring)."""
        if self.lockstep:
            return await self._run_in_lockstep()
        core, workers = self.core, self.workers
        in_flight: deque[pb.SchedulerOutput] = deque()
        steps = 0
        while True:
            while len(in_flight) < self.depth and core.has_unfinished_requests():
                so = core.schedule()
                if not so.num_scheduled_tokens and not so.HasField("kv_connector_metadata"):
                    break
                # (A step of KV connector metadata alone starts transfers, or lets the worker report
                # those in flight: requests wait on them, and nothing else may be runnable.)
                await workers.submit(so)
                in_flight.append(so)
            if not in_flight:
                self.emit(core.take_failed_outputs())  # requests whose grammar failed to compile
                return steps
            so = in_flight.popleft()
            outputs = core.process(so, await workers.collect())
            steps += 1
            if in_flight and (followup := core.grammar_followup(in_flight[0])) is not None:
                await workers.submit(followup)  # the next step's constrained rows: their bitmask
            self.emit(outputs)
            self.after_step()
            # Let the owner's other tasks (gateway streams) run between steps; a step that only
            # polled the worker's transfers waits a moment before the next poll.
            await asyncio.sleep(0 if so.num_scheduled_tokens else KV_TRANSFER_POLL_S)

    async def _run_in_lockstep(self) -> int:
        """Step while the group's wave runs or this engine has work (its steps then wait in the
        exchanges until the others start: whoever owns the wave wakes them); returns the number
        of steps, with `group_running` False: the group paused after the last one."""
        core, workers = self.core, self.workers
        steps = 0
        while self.group_running or core.has_unfinished_requests():
            if not self.group_running:
                self.on_work_while_paused()
            so = core.schedule()  # (possibly empty: a dummy step)
            so.dp_local_unfinished = core.has_unfinished_requests()
            await workers.submit(so)
            answer = await workers.collect()
            steps += 1
            if so.num_scheduled_tokens:
                outputs = core.process(so, answer)
            else:
                if answer.error:
                    raise RuntimeError(f"worker failed: {answer.error}")
                core.num_dummy_steps += 1
                outputs = core.take_failed_outputs()
            was_running, self.group_running = self.group_running, answer.dp_global_unfinished
            if was_running and not self.group_running:
                self.on_group_pause()  # (it may start the next wave at once)
            self.emit(outputs)
            self.after_step()
            await asyncio.sleep(0)
        return steps

    async def fail_all(self, message: str, kind: int = pb.ENGINE_FAULT) -> None:
        """A step failed: neither the ranks' batch nor the KV a step was writing can be trusted.
        The ranks forget everything, every request ends with `message` (all blocks freed, the
        prefix cache dropped), and the loop can run again on a clean slate."""
        await self.workers.reset()
        self.emit(self.core.fail_all(message, kind))
