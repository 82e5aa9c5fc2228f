"""The scheduler's grammars: compiled once per constraint (cached), off the engine loop and
within a time limit, and one matcher per constrained request whose allowed-token rows are
filled off the engine loop too.

A request arrives with a `StructuredOutputs` spec. Its grammar is parsed and compiled
against the tokenizer by a helper process (services/engine/grammar_compiler.py), at most
`COMPILE_WORKERS` at once; until that is done the request waits without holding up the batch
(vLLM's WAITING_FOR_FSM). An invalid spec ends the request with an INVALID_REQUEST error then
(the gateway and the offline `LLM` refuse one before sending it), and so does one that does
not compile within --structured-outputs-compile-timeout (the helper kills that compile).

Each running constrained request's row of allowed next tokens is filled on a small thread
pool as soon as its matcher advances (xgrammar releases the GIL while it fills). The step
takes the rows that are ready: it waits for rows at most `STEP_FILL_WAIT_S` in all, and a
request whose row is not ready sits the step out (it keeps its blocks and its place) instead
of making every other request wait for it. Most rows take tens of microseconds, but some
grammars take 100 ms for one row (a JSON string with a bounded-repetition pattern), every
token. The rows travel packed with the SchedulerOutput (or, with async scheduling, in a
message right after it), the worker masks those rows' logits, and the sampled tokens advance
the matchers when the step's outputs are folded in.

Each request has a budget of wall-clock time for its grammar work,
--structured-outputs-request-timeout: the time it waited for its compile (queue included), and
the time each of its rows took to fill and each of its tokens to advance the matcher. A compile
within its CPU limit can still take minutes of wall-clock time when the machine is busy (the
helper runs at the lowest priority: a regex like `((a{1,1000}){1,1000}){1,1000}b` compiles in
milliseconds but serializes to ~10 MB, which can take a minute of wall-clock time at that
priority on a loaded machine), and some grammars' rows and advances grow with every token (the same
regex: each 4-byte token roughly doubles them). Past the budget the scheduler ends the request
with a 400 naming the flag; the work already under way (a compile other requests may share, a
row being filled) runs to its end, but nothing more is started for the request.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from services.common.config import (
    DEFAULT_STRUCTURED_OUTPUTS_COMPILE_TIMEOUT_S,
    DEFAULT_STRUCTURED_OUTPUTS_REQUEST_TIMEOUT_S,
)
from services.common.proto import myvllm_pb2 as pb
from services.common.structured_outputs import StructuredOutputsError, spec_key
from services.engine.grammar_compiler import GrammarCompileProcess, GrammarCompileTimeout

logger = logging.getLogger(__name__)

# Compiled grammars kept (least recently used dropped first).
GRAMMAR_CACHE_SIZE = 256
# Compiles running at once (each a child of the helper process); more wait in line. Two: one
# pathological constraint (running until its timeout) does not hold up every other one.
COMPILE_WORKERS = 2
# Threads filling allowed-token rows.
FILL_WORKERS = 2
# How long one step waits, in all, for rows still being filled (only for grammars whose last
# row took no longer than this; a slow one is never waited for). Past it the request sits the
# step out.
STEP_FILL_WAIT_S = 0.005


class GrammarBudgetExceeded(StructuredOutputsError):
    """A request's grammar work took longer than --structured-outputs-request-timeout (a 400:
    the constraint is what takes too long)."""

    def __init__(self, budget_s: float) -> None:
        super().__init__(f"structured output grammar work took longer than the {budget_s:g} s of wall-clock time "
                         "a request may spend on it (--structured-outputs-request-timeout)", "structured_outputs")
        self.budget_s = budget_s


class _DeadlineWaker:
    """Calls `callback` at each deadline it is given (one daemon thread, started at the first):
    an idle engine loop must wake up to end a request whose grammar budget ran out while it
    waited for a compile or a row that is still not done."""

    def __init__(self) -> None:
        self.callback: Callable[[], None] | None = None
        self._deadlines: list[float] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def wake_at(self, deadline: float) -> None:
        with self._cond:
            heapq.heappush(self._deadlines, deadline)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="grammar-budget", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._deadlines or self._deadlines[0] > time.monotonic():
                    self._cond.wait(self._deadlines[0] - time.monotonic() if self._deadlines else None)
                now = time.monotonic()
                while self._deadlines and self._deadlines[0] <= now:
                    heapq.heappop(self._deadlines)
                callback = self.callback
            if callback is not None:
                callback()


def _compile_again(future: Future) -> bool:
    """Whether a cached compile failed for a reason other than the constraint itself."""
    if not future.done():
        return False
    if future.cancelled():
        return True
    error = future.exception()
    return error is not None and not isinstance(error, StructuredOutputsError)


class RequestGrammar:
    """One request's constraint: its compiled grammar (maybe still compiling), then its matcher
    and the allowed-token row for the matcher's current state (maybe still being filled)."""

    def __init__(self, compiled: Future, manager: StructuredOutputManager | None = None) -> None:
        self.compiled = compiled
        self.manager = manager
        self.matcher: Any = None  # xgrammar.GrammarMatcher once compiled
        self._row: Future | None = None  # int32 [1, num_words] for the current state
        self._row_watched: Future | None = None  # the row whose completion wakes the engine loop
        self.fill_seconds: float | None = None  # how long the last row took (None: none yet)
        # The request's grammar budget: wall-clock seconds of grammar work it may wait for.
        self.budget_s = manager.request_timeout_s if manager is not None else None
        self._created = time.monotonic()
        self._compile_wait: float | None = None  # (None: still compiling)
        self._spent = 0.0  # rows filled, tokens accepted
        self._fill_started: float | None = None  # a row being filled right now
        compiled.add_done_callback(self._compile_done)  # (at once for a cached grammar: no wait)

    @property
    def is_compiling(self) -> bool:
        return self.matcher is None and not self.compiled.done()

    def start(self, output_token_ids: Iterable[int]) -> None:
        """Build the matcher (the grammar is compiled) and feed it the tokens the request already
        has (a migrated request's outputs). Raises the compile error, if there was one."""
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(self.compiled.result())
        for token_id in output_token_ids:
            if not self.accept(token_id):
                raise ValueError(f"resumed output token {token_id} does not match the request's grammar")
        self.prefetch()

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False if the grammar does not allow it. (Never while
        the row is being filled: a token is sampled with the row, so it is done.)"""
        self._row = None
        start = time.monotonic()
        accepted = bool(self.matcher.accept_token(int(token_id)))
        self._spent += time.monotonic() - start
        return accepted

    # ------------------------------------------------------------------ the time budget

    def _compile_elapsed(self, now: float) -> float:
        """How long the request has waited for its compile, the helper's start-up left out."""
        ready_since = self.manager.compiler.ready_since if self.manager is not None else self._created
        return 0.0 if ready_since is None else max(now - max(self._created, ready_since), 0.0)

    def _compile_done(self, _: Future) -> None:
        self._compile_wait = self._compile_elapsed(time.monotonic())

    def seconds_spent(self, now: float | None = None) -> float:
        """Wall-clock seconds of grammar work so far, the compile or row under way included."""
        now = time.monotonic() if now is None else now
        if self._compile_wait is None:
            return self._compile_elapsed(now)
        started = self._fill_started
        return self._compile_wait + self._spent + (now - started if started is not None else 0.0)

    def over_budget(self, now: float | None = None) -> bool:
        return self.budget_s is not None and self.seconds_spent(now) > self.budget_s

    def budget_error(self) -> GrammarBudgetExceeded:
        return GrammarBudgetExceeded(self.budget_s)

    def budget_deadline(self) -> float | None:
        """When the budget runs out if the work under way goes on (None: no budget)."""
        if self.budget_s is None:
            return None
        now = time.monotonic()
        return now + self.budget_s - self.seconds_spent(now)

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    # ------------------------------------------------------------------ allowed-token rows

    def prefetch(self) -> None:
        """Start filling the row for the matcher's current state (if not already)."""
        if self._row is None and self.manager is not None and not self.matcher.is_terminated() \
                and not self.over_budget():  # (its request is ended at the next schedule)
            self._row = self.manager.fill_pool.submit(self._fill)

    def _fill(self) -> np.ndarray:
        import xgrammar as xgr

        row = xgr.allocate_token_bitmask(1, self.manager.vocab_size)
        self._fill_started = start = time.monotonic()
        try:
            self.matcher.fill_next_token_bitmask(row, 0)
        finally:
            self.fill_seconds = time.monotonic() - start
            self._spent += self.fill_seconds
            self._fill_started = None
        return row.numpy()

    @property
    def row_ready(self) -> bool:
        return self._row is not None and self._row.done()

    def fills_within(self, seconds: float) -> bool:
        """Whether the last row took no longer than `seconds` (what a step waits for one)."""
        return self.fill_seconds is not None and self.fill_seconds <= seconds

    def row(self) -> np.ndarray:
        """The row for the current state (waits for it, filling it first if need be)."""
        if self._row is None and self.over_budget():
            # Past its budget no row is filled: the request is ended at the next schedule, before
            # the token sampled with this row is folded in (it is dropped), so any row will do.
            return np.full((1, self.manager.num_words), -1, dtype=np.int32)
        if self._row is None:
            if self.manager is None:  # (no pool: fill here)
                done: Future = Future()
                done.set_result(self._fill())
                self._row = done
            else:
                self.prefetch()
        return self._row.result()

    @property
    def pending(self) -> Future | None:
        """What this request waits for before it can be scheduled: its compile or its row."""
        if self.matcher is None:
            return None if self.compiled.done() else self.compiled
        return self._row if self._row is not None and not self._row.done() else None

    def watch_row(self, callback: Callable[[], None] | None) -> None:
        """Call `callback` when the row being filled is done (once per row)."""
        row = self._row
        if callback is None or row is None or row is self._row_watched:
            return
        self._row_watched = row
        row.add_done_callback(lambda _: callback())
        deadline = self.budget_deadline()
        if deadline is not None and self.manager is not None:
            self.manager.waker.wake_at(deadline)  # a row that never comes must not keep it waiting


class StructuredOutputManager:
    """Compiles and caches grammars for one model's tokenizer; fills the step bitmasks."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: Iterable[int], max_num_seqs: int,
                 compile_timeout_s: float = DEFAULT_STRUCTURED_OUTPUTS_COMPILE_TIMEOUT_S,
                 compile_workers: int = COMPILE_WORKERS,
                 request_timeout_s: float = DEFAULT_STRUCTURED_OUTPUTS_REQUEST_TIMEOUT_S) -> None:
        if not compile_timeout_s > 0:
            raise ValueError(f"structured outputs compile timeout must be positive, got {compile_timeout_s}")
        if not request_timeout_s > 0:
            raise ValueError(f"structured outputs request timeout must be positive, got {request_timeout_s}")
        self.request_timeout_s = request_timeout_s
        self.waker = _DeadlineWaker()
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.num_words = -(-vocab_size // 32)
        self.compile_timeout_s = compile_timeout_s
        self._tokenizer_info: Any = None
        self._tokenizer_info_lock = threading.Lock()
        # Each pool thread waits on one job of the helper process: the pool bounds the compiles
        # that run at once; the helper bounds how long each may run.
        self._executor = ThreadPoolExecutor(max_workers=compile_workers, thread_name_prefix="grammar-compile")
        self.compiler = GrammarCompileProcess(lambda: self._get_tokenizer_info().serialize_json(), compile_timeout_s)
        self.fill_pool = ThreadPoolExecutor(max_workers=FILL_WORKERS, thread_name_prefix="grammar-fill")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.num_compiles = 0
        self.compile_seconds = 0.0
        self.cache_hits = 0
        self.num_compile_timeouts = 0
        # Called (on a pool thread) when a grammar or a row a request waits for is ready: an
        # idle engine loop must wake up to schedule it.
        self.on_ready = None

    @property
    def on_ready(self) -> Callable[[], None] | None:
        return self._on_ready

    @on_ready.setter
    def on_ready(self, callback: Callable[[], None] | None) -> None:
        self._on_ready = self.waker.callback = callback

    def _get_tokenizer_info(self) -> Any:
        """xgrammar's view of this tokenizer (built once: reads the whole vocabulary)."""
        with self._tokenizer_info_lock:
            if self._tokenizer_info is None:
                import xgrammar as xgr

                from services.text.hf_tokenizer import load_hf_tokenizer

                tokenizer = load_hf_tokenizer(self.model_dir)
                self._tokenizer_info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None)
            return self._tokenizer_info

    def grammar_for(self, spec: pb.StructuredOutputs) -> RequestGrammar:
        """The request's grammar: from the cache, else parsed and compiled in the background.
        A constraint that failed for what it is (invalid, or too slow to compile) stays cached
        as failed: sending it again fails at once instead of costing another compile; one the
        engine failed (the helper process died) is compiled again."""
        key = spec_key(spec)
        future = self._cache.get(key)
        if future is not None and not _compile_again(future):
            self._cache.move_to_end(key)
            self.cache_hits += 1
        else:
            future = self._executor.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        grammar = RequestGrammar(future, self)
        if self.on_ready is not None and not future.done():
            callback = self.on_ready
            future.add_done_callback(lambda _: callback())
            self.waker.wake_at(grammar.budget_deadline())  # the compile may outlast the request's budget
        return grammar

    def _compile(self, spec: pb.StructuredOutputs) -> Any:
        import xgrammar as xgr

        try:
            compiled_json, seconds = self.compiler.compile(spec.SerializeToString())
        except GrammarCompileTimeout:
            self.num_compile_timeouts += 1
            raise
        compiled = xgr.CompiledGrammar.deserialize_json(compiled_json, self._get_tokenizer_info())
        self.compile_seconds += seconds
        self.num_compiles += 1
        return compiled

    @staticmethod
    def wait_for_any(grammars: Iterable[RequestGrammar], timeout: float | None = None) -> None:
        """Block until one of the grammars' compile or row they wait for is ready, or one's
        budget runs out (or `timeout`)."""
        grammars = list(grammars)
        futures = [f for g in grammars if (f := g.pending) is not None]
        if not futures:
            return
        deadlines = [d for g in grammars if (d := g.budget_deadline()) is not None]
        if deadlines:
            left = max(min(deadlines) - time.monotonic(), 0.0)
            timeout = left if timeout is None else min(timeout, left)
        wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def fill_bitmask(self, grammars: list[RequestGrammar]) -> bytes:
        """Packed allowed-token rows for `grammars`, in order (int32 words, little-endian)."""
        return np.concatenate([g.row() for g in grammars]).astype("<i4", copy=False).tobytes()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.fill_pool.shutdown(wait=False, cancel_futures=True)
        self.compiler.close()
