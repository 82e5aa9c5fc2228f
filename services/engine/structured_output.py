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
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from services.common.config import DEFAULT_STRUCTURED_OUTPUTS_COMPILE_TIMEOUT_S
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
        return bool(self.matcher.accept_token(int(token_id)))

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    # ------------------------------------------------------------------ allowed-token rows

    def prefetch(self) -> None:
        """Start filling the row for the matcher's current state (if not already)."""
        if self._row is None and self.manager is not None and not self.matcher.is_terminated():
            self._row = self.manager.fill_pool.submit(self._fill)

    def _fill(self) -> np.ndarray:
        import xgrammar as xgr

        row = xgr.allocate_token_bitmask(1, self.manager.vocab_size)
        start = time.perf_counter()
        self.matcher.fill_next_token_bitmask(row, 0)
        self.fill_seconds = time.perf_counter() - start
        return row.numpy()

    @property
    def row_ready(self) -> bool:
        return self._row is not None and self._row.done()

    def fills_within(self, seconds: float) -> bool:
        """Whether the last row took no longer than `seconds` (what a step waits for one)."""
        return self.fill_seconds is not None and self.fill_seconds <= seconds

    def row(self) -> np.ndarray:
        """The row for the current state (waits for it, filling it first if need be)."""
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


class StructuredOutputManager:
    """Compiles and caches grammars for one model's tokenizer; fills the step bitmasks."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: Iterable[int], max_num_seqs: int,
                 compile_timeout_s: float = DEFAULT_STRUCTURED_OUTPUTS_COMPILE_TIMEOUT_S,
                 compile_workers: int = COMPILE_WORKERS) -> None:
        if not compile_timeout_s > 0:
            raise ValueError(f"structured outputs compile timeout must be positive, got {compile_timeout_s}")
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
        self.on_ready: Callable[[], None] | None = None

    def _get_tokenizer_info(self) -> Any:
        """xgrammar's view of this tokenizer (built once: reads the whole vocabulary)."""
        with self._tokenizer_info_lock:
            if self._tokenizer_info is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
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
        if self.on_ready is not None and not future.done():
            callback = self.on_ready
            future.add_done_callback(lambda _: callback())
        return RequestGrammar(future, self)

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
        """Block until one of the grammars' compile or row they wait for is ready (or `timeout`)."""
        futures = [f for g in grammars if (f := g.pending) is not None]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def fill_bitmask(self, grammars: list[RequestGrammar]) -> bytes:
        """Packed allowed-token rows for `grammars`, in order (int32 words, little-endian)."""
        return np.concatenate([g.row() for g in grammars]).astype("<i4", copy=False).tobytes()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.fill_pool.shutdown(wait=False, cancel_futures=True)
        self.compiler.close()
