"""The scheduler's grammars: compiled once per constraint (cached), off the engine loop, and
one matcher per constrained request.

A request arrives with a `StructuredOutputs` spec. Its grammar is parsed and compiled
against the tokenizer on a background thread; until that is done the request waits without
holding up the batch (vLLM's WAITING_FOR_FSM). An invalid spec ends the request with an
INVALID_REQUEST error then (the gateway and the offline `LLM` refuse one before sending it).

After each schedule the scheduler asks for the allowed-token bitmask of the constrained rows
that sample in the step; it travels packed with the SchedulerOutput (or, with async
scheduling, in a message right after it), the worker masks those rows' logits, and the
sampled tokens advance the matchers when the step's outputs are folded in.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from services.common.proto import myvllm_pb2 as pb
from services.common.structured_outputs import build_grammar, spec_key

logger = logging.getLogger(__name__)

# Compiled grammars kept (least recently used dropped first).
GRAMMAR_CACHE_SIZE = 256


class RequestGrammar:
    """One request's constraint: its compiled grammar (maybe still compiling), then its matcher."""

    def __init__(self, compiled: Future) -> None:
        self.compiled = compiled
        self.matcher: Any = None  # xgrammar.GrammarMatcher once compiled

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

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False if the grammar does not allow it."""
        return bool(self.matcher.accept_token(int(token_id)))

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class StructuredOutputManager:
    """Compiles and caches grammars for one model's tokenizer; fills the step bitmasks."""

    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: Iterable[int], max_num_seqs: int) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.num_words = -(-vocab_size // 32)
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self._bitmask: Any = None  # torch int32 [max_num_seqs, num_words], allocated on first use
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.num_compiles = 0
        self.compile_seconds = 0.0
        self.cache_hits = 0
        # Called (on the compile thread) when a grammar a request waits for is ready: an idle
        # engine loop must wake up to schedule it.
        self.on_compiled: Callable[[], None] | None = None

    def _get_compiler(self) -> Any:
        """The xgrammar compiler for this tokenizer (built once: reads the whole vocabulary)."""
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.eos_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def grammar_for(self, spec: pb.StructuredOutputs) -> RequestGrammar:
        """The request's grammar: from the cache, else parsed and compiled in the background."""
        key = spec_key(spec)
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            self.cache_hits += 1
        else:
            future = self._executor.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        if self.on_compiled is not None and not future.done():
            callback = self.on_compiled
            future.add_done_callback(lambda _: callback())
        return RequestGrammar(future)

    def _compile(self, spec: pb.StructuredOutputs) -> Any:
        grammar = build_grammar(spec)  # an invalid spec raises StructuredOutputsError (the request's error)
        compiler = self._get_compiler()
        start = time.perf_counter()
        compiled = compiler.compile_grammar(grammar)
        self.compile_seconds += time.perf_counter() - start
        self.num_compiles += 1
        return compiled

    @staticmethod
    def wait_for_any(grammars: Iterable[RequestGrammar], timeout: float | None = None) -> None:
        """Block until one of the still-compiling grammars is ready (or `timeout` passes)."""
        futures = [g.compiled for g in grammars if g.is_compiling]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def fill_bitmask(self, grammars: list[RequestGrammar]) -> bytes:
        """Packed allowed-token rows for `grammars`, in order (int32 words, little-endian)."""
        if self._bitmask is None:
            import xgrammar as xgr

            self._bitmask = xgr.allocate_token_bitmask(self.max_num_seqs, self.vocab_size)
        for i, grammar in enumerate(grammars):
            grammar.matcher.fill_next_token_bitmask(self._bitmask, i)
        return self._bitmask[:len(grammars)].numpy().astype("<i4", copy=False).tobytes()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
