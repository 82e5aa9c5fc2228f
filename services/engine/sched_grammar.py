"""The scheduler's part of structured outputs: which constrained requests may run in a step (their
grammar compiled, their allowed-token row filled in time), their bitmask rows, and the grammar
work budget (--structured-outputs-request-timeout). Inert when no request may be constrained."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import wait

from services.common import message_limits
from services.common.proto import myvllm_pb2 as pb
from services.common.structured_outputs import StructuredOutputsError
from services.engine.request import Request, RequestStatus
from services.engine.structured_output import STEP_FILL_WAIT_S, RequestGrammar, StructuredOutputManager

logger = logging.getLogger(__name__)


def _failed_output(request: Request, kind: int, error: str) -> pb.RequestOutput:
    return pb.RequestOutput(request_id=request.request_id, finish_reason="abort", stop_token_id=-1,
                            num_prompt_tokens=request.num_prompt_tokens, error_kind=kind, error=error)


class GrammarHooks:
    def __init__(self, manager: StructuredOutputManager | None, abort: Callable[[list[str]], object],
                 finish: Callable[[Request, RequestStatus], object]) -> None:
        """`abort` / `finish`: the scheduler's, to end a request whose grammar failed or ran over."""
        self.manager = manager
        self.abort = abort
        self.finish = finish
        self.row_bytes = message_limits.bitmask_row_bytes(manager.vocab_size) if manager is not None else 0
        # Live constrained requests, whose grammar budgets each schedule checks.
        self.constrained: dict[str, Request] = {}
        # Requests ended outside a step (their grammar failed to compile): reported with the
        # next step's outputs, or by `take_failed_outputs` when no step runs.
        self.failed_outputs: list[pb.RequestOutput] = []
        # Async scheduling: steps sent before their constrained rows' matchers caught up, by step
        # id, with those rows' requests; their bitmask follows once the tokens are folded in.
        self.deferred_bitmasks: dict[int, list[Request]] = {}
        # Constrained requests the last step left out because their row was not filled yet.
        self.row_waiters: list[RequestGrammar] = []
        # How long one step waits for rows in all (tests that need the same batches on any
        # machine, loaded or not, raise it so that every row is waited for).
        self.step_fill_wait_s = STEP_FILL_WAIT_S
        self._fill_wait_left = self.step_fill_wait_s
        self.num_row_waits = 0
        self.num_budget_exceeded = 0

    def begin_step(self) -> None:
        self._fill_wait_left = self.step_fill_wait_s
        self.row_waiters = []
        if self.constrained:
            self._end_over_budget()

    def _end_over_budget(self) -> None:
        """End the constrained requests whose grammar work took longer than their budget
        (--structured-outputs-request-timeout) with that error, as a failed compile ends one.
        A token of theirs still in flight is dropped, as an abort's is."""
        now = time.monotonic()
        over = [r for r in self.constrained.values() if r.grammar.over_budget(now)]
        for request in over:
            error = request.grammar.budget_error()
            logger.warning("request %s: %s", request.request_id, error)
            self.abort([request.request_id])
            self.num_budget_exceeded += 1
            self.failed_outputs.append(_failed_output(request, pb.INVALID_REQUEST, str(error)))

    def ready(self, request: Request) -> bool:
        """Whether `request`'s grammar is compiled (its matcher built); a grammar that failed to
        compile ends the request with the error."""
        grammar = request.grammar
        if grammar.matcher is not None:
            return True
        if grammar.is_compiling:
            return False
        try:
            grammar.start(request.output_token_ids)
        except Exception as e:  # an invalid spec, a compile timeout or error, or resumed tokens off-grammar
            logger.warning("request %s: structured output grammar failed: %s", request.request_id, e)
            # The constraint's fault (a 400), unless the compiler itself failed (the engine's).
            kind = pb.INVALID_REQUEST if isinstance(e, ValueError) else pb.ENGINE_FAULT
            message = str(e) if isinstance(e, StructuredOutputsError) else f"structured outputs: {e}"
            self.finish(request, RequestStatus.FINISHED_ABORTED)
            self.failed_outputs.append(_failed_output(request, kind, message))
            return False
        return True

    def waits_for_row(self, request: Request, num_new: int, num_computed: int | None = None) -> bool:
        """Whether a constrained `request` that would sample in this step sits it out because
        its allowed-token row is not filled yet. Rows of grammars known to fill fast are waited
        for, up to `step_fill_wait_s` per step in all; a slow one is never waited for. With a token
        still in flight (async scheduling) the row can only be filled once it is back, while the
        step already runs: only a fast grammar may take that path."""
        grammar = request.grammar
        if grammar is None or grammar.matcher is None:
            return False
        computed = request.num_computed_tokens if num_computed is None else num_computed
        if computed + num_new < request.num_tokens:
            return False  # a prompt chunk that samples nothing
        if request.num_output_placeholders:
            return not grammar.fills_within(self.step_fill_wait_s)
        grammar.prefetch()
        pending = grammar.pending
        waited_for = grammar.fill_seconds is None or grammar.fills_within(self.step_fill_wait_s)
        if pending is not None and self._fill_wait_left > 0 and waited_for:
            start = time.perf_counter()
            wait([pending], timeout=self._fill_wait_left)
            self._fill_wait_left -= time.perf_counter() - start
        if grammar.row_ready:
            return False
        grammar.watch_row(self.manager.on_ready if self.manager is not None else None)
        self.row_waiters.append(grammar)
        self.num_row_waits += 1
        return True

    @staticmethod
    def num_compiling(waiting: Iterable[Request]) -> int:
        """Waiting requests passed over until their grammar compiles."""
        return sum(1 for r in waiting if r.grammar is not None and r.grammar.is_compiling)

    def compiling(self, waiting: Iterable[Request]) -> list[RequestGrammar]:
        """Grammars that requests wait for: waiting requests' compiles, and the rows of those
        the last step left out."""
        compiling = [r.grammar for r in waiting if r.grammar is not None and r.grammar.is_compiling]
        return compiling + self.row_waiters

    def take_failed_outputs(self) -> list[pb.RequestOutput]:
        failed, self.failed_outputs = self.failed_outputs, []
        return failed

    def attach_bitmask(self, out: pb.SchedulerOutput, scheduled: list[tuple[Request, int]], lagging: bool) -> None:
        """The allowed-token rows of the constrained requests that sample in this step, now, or
        (when a matcher waits for a token still in flight) in a message that follows the step."""
        constrained = [r for r, _ in scheduled if r.grammar is not None and r.num_computed_tokens >= r.num_tokens]
        if not constrained:
            return
        if lagging:
            out.grammar_bitmask_follows = True
            self.deferred_bitmasks[out.step_id] = constrained
            return
        self._fill_bitmask(out, constrained)

    def _fill_bitmask(self, out: pb.SchedulerOutput, constrained: list[Request]) -> None:
        out.structured_output_request_ids.extend(r.request_id for r in constrained)
        out.grammar_bitmask = self.manager.fill_bitmask([r.grammar for r in constrained])

    def followup(self, scheduler_output: pb.SchedulerOutput, requests: dict[str, Request]) -> pb.SchedulerOutput | None:
        """For a step sent with `grammar_bitmask_follows`: the message with its bitmask, to send
        once the previous step's tokens are folded in (None for any other step). Requests that
        ended meanwhile get no row (the worker samples them unmasked; their token is dropped)."""
        constrained = self.deferred_bitmasks.pop(scheduler_output.step_id, None)
        if constrained is None:
            return None
        out = pb.SchedulerOutput(step_id=scheduler_output.step_id, grammar_bitmask_only=True)
        live = [r for r in constrained if requests.get(r.request_id) is r and r.status == RequestStatus.RUNNING]
        if live:
            self._fill_bitmask(out, live)
        return out

    @staticmethod
    def advance(request: Request, token_id: int) -> RequestStatus | None:
        """Feed the sampled token to the request's matcher: a finished grammar ends the request
        with `stop` (as does a token the grammar refuses, which only an all-banned row yields)."""
        if not request.grammar.accept(token_id):
            logger.warning("request %s: token %d is outside its grammar; stopping it", request.request_id, token_id)
            return RequestStatus.FINISHED_STOPPED
        if request.grammar.is_terminated:
            return RequestStatus.FINISHED_STOPPED
        return None
