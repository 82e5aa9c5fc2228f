"""The scheduler: one token budget per step, running requests first, then waiting ones.

There is no prefill or decode phase. Each request needs `num_tokens - num_computed_tokens`
more tokens computed; a long prompt is cut into chunks by the budget (chunked prefill)
while decodes of other requests continue in the same step. When the block pool runs dry,
running requests are preempted by recompute: their blocks are freed and they go back to
the head of the waiting queue (the prefix cache usually hands most blocks back later).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import wait

from services.common import message_limits
from services.common.kv_transfer_config import KVTransferConfig
from services.common.message_limits import STEP_BUDGET_BYTES
from services.common.proto import myvllm_pb2 as pb
from services.common.spec_config import SpeculativeConfig, may_speculate
from services.common.structured_outputs import StructuredOutputsError
from services.engine.kv_cache_manager import KVCacheManager
from services.engine.kv_connector import KVConnectorScheduler
from services.engine.request import Request, RequestStatus
from services.engine.spec_decode import (
    WORKER_DRAFT,
    SpecDecodeStats,
    drafts_per_step,
    lookahead_slots,
    max_drafts,
    worker_drafts,
)
from services.engine.structured_output import STEP_FILL_WAIT_S, RequestGrammar, StructuredOutputManager

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns the waiting/running queues and every request's KV blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        policy: str = "fcfs",
        async_scheduling: bool = False,
        pipeline_parallel: bool = False,
        structured_output: StructuredOutputManager | None = None,
        speculative_config: SpeculativeConfig | None = None,
        kv_transfer_config: KVTransferConfig | None = None,
        kv_producer_address: str | None = None,
    ) -> None:
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        # With async scheduling step N+1 is scheduled before step N's tokens are back.
        self.async_scheduling = async_scheduling
        # With pipeline parallelism the first stage never sees sampled tokens: cached requests
        # carry the tokens each step computes. (A decode in flight is not scheduled again until
        # its token is back: its num_computed_tokens already equals num_tokens.)
        self.pipeline_parallel = pipeline_parallel
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Ids the worker must drop at the next step (finished, aborted or preempted).
        self.finished_req_ids: set[str] = set()
        # Requests whose state the worker holds (scheduled since their last preemption).
        self.worker_known: set[str] = set()
        # P/D disaggregation (None: no KV connector). Requests whose blocks a remote load fills
        # (they hold blocks, not a batch slot), and ended requests whose blocks wait for a transfer
        # to end (a producer's save, an aborted consumer's load) before they are freed.
        self.kv_connector = KVConnectorScheduler(kv_transfer_config, block_size, kv_producer_address) \
            if kv_transfer_config is not None else None
        self.waiting_for_remote: dict[str, Request] = {}
        self.finishing: dict[str, Request] = {}
        # A producer's final output, held until its save is reported: the handle it carries then
        # names a whole segment, so the consumer it goes to never waits for one or reads half.
        self.held_outputs: dict[str, pb.RequestOutput] = {}
        self.num_preemptions = 0
        self.step_id = 0
        # Grammars and step bitmasks of constrained requests (None: no request may be constrained).
        self.structured_output = structured_output
        # Requests ended outside a step (their grammar failed to compile): reported with the
        # next step's outputs, or by `take_failed_outputs` when no step runs.
        self.failed_outputs: list[pb.RequestOutput] = []
        # Async scheduling: steps sent before their constrained rows' matchers caught up, by step
        # id, with those rows' requests; their bitmask follows once the tokens are folded in.
        self.deferred_bitmasks: dict[int, list[Request]] = {}
        # Constrained requests the last step left out because their row was not filled yet.
        self._row_waiters: list[RequestGrammar] = []
        # How long one step waits for rows in all (tests that need the same batches on any
        # machine, loaded or not, raise it so that every row is waited for).
        self.step_fill_wait_s = STEP_FILL_WAIT_S
        self._fill_wait_left = self.step_fill_wait_s
        self.num_row_waits = 0
        # Live constrained requests, whose grammar budgets each schedule checks.
        self._constrained: dict[str, Request] = {}
        self.num_grammar_budget_exceeded = 0
        # Speculative decoding (None: off): drafts come back from the worker with each step.
        self.speculative_config = speculative_config
        self.num_lookahead_slots = lookahead_slots(speculative_config)
        num_drafts = drafts_per_step(speculative_config)
        self.spec_stats = SpecDecodeStats(num_drafts)
        # Each step's message stays within STEP_BUDGET_BYTES, what the worker reads (a step with
        # many new requests of long prompts or big sampling parameters, as after a worker
        # restart, is spread over several); the first request of a step always goes, so one
        # request's data must fit.
        self.bitmask_row_bytes = message_limits.bitmask_row_bytes(structured_output.vocab_size) \
            if structured_output is not None else 0
        largest = message_limits.new_request_bytes(
            message_limits.MAX_REQUEST_ID_CHARS, max_model_len, self._max_blocks(max_model_len),
            message_limits.sampling_params_bytes()) + (1 + num_drafts) * self.bitmask_row_bytes
        if largest > STEP_BUDGET_BYTES:
            raise ValueError(f"max_model_len {max_model_len}: one request's data in a step could take {largest} "
                             f"bytes, above the {STEP_BUDGET_BYTES} a step may carry (lower --max-model-len)")

    # ------------------------------------------------------------------ queue management

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self.finishing:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        # (An embedding request generates nothing: its prompt may fill the context.)
        if request.num_tokens > self.max_model_len or (request.num_tokens == self.max_model_len
                                                        and not request.is_pooling):
            raise ValueError(
                f"prompt has {request.num_tokens} tokens; max_model_len is {self.max_model_len}")
        # A request that could not finish even with the whole pool to itself would preempt
        # itself forever: refuse it now, with the numbers.
        capacity = (self.kv_cache_manager.block_pool.num_blocks - 1) * self.block_size
        # (max_tokens counts a migrated request's resumed outputs too: they are not extra.)
        # (A draft model's lookahead slots count: the scheduler allocates them with every step.)
        needed = min(request.num_prompt_tokens + request.max_tokens + self.num_lookahead_slots, self.max_model_len)
        if needed > capacity:
            raise ValueError(
                f"request needs KV cache for up to {needed} tokens ({request.num_prompt_tokens} prompt + "
                f"{request.max_tokens} max_tokens) but the cache holds only {capacity}")
        self.requests[request.request_id] = request
        if request.grammar is not None:
            self._constrained[request.request_id] = request
        self._enqueue_waiting(request)

    def _enqueue_waiting(self, request: Request) -> None:
        if self.policy == "priority":
            # Keep waiting sorted by (priority, arrival); stable for equal keys.
            key = request.sort_key()
            idx = len(self.waiting)
            while idx > 0 and self.waiting[idx - 1].sort_key() > key:
                idx -= 1
            self.waiting.insert(idx, request)
        else:
            self.waiting.append(request)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        """Finish the given requests as aborted; returns those that were live."""
        aborted = []
        for rid in request_ids:
            if self.held_outputs.pop(rid, None) is not None:  # ended; its save not yet reported
                request = self.finishing[rid]
                request.kv_discard_after_save = True  # nobody will read it
                aborted.append(request)
                continue
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self.waiting_for_remote[rid]
            else:
                self.waiting.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            aborted.append(request)
        return aborted

    def _finish(self, request: Request, status: RequestStatus) -> pb.KVTransferParams | None:
        """End `request` and free its blocks (unless a transfer still uses them: then when it ends).
        Returns the KV transfer params its final output carries (a producer's), if any."""
        request.status = status
        request.spec_token_ids = []
        delay, params = False, None
        if self.kv_connector is not None:
            delay, params = self.kv_connector.request_finished(request, status == RequestStatus.FINISHED_ABORTED)
            delay = delay or request.request_id in self.kv_connector.loading
        if delay:
            self.finishing[request.request_id] = request
        else:
            self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._constrained.pop(request.request_id, None)
        if request.request_id in self.worker_known:
            self.worker_known.discard(request.request_id)
            self.finished_req_ids.add(request.request_id)
        return params

    def _transfer_ended(self, request_id: str) -> None:
        """A transfer of an ended request is over: its blocks go back now."""
        request = self.finishing.pop(request_id, None)
        if request is not None:
            self.kv_cache_manager.free(request)

    def _update_from_kv_xfer_finished(self, runner_output: pb.ModelRunnerOutput) -> list[pb.RequestOutput]:
        """The worker's transfer reports (vLLM's name). A finished save frees an ended producer
        request's blocks and releases its held final output; a finished load makes its request
        schedulable with those tokens computed (their blocks now cached), a failed one makes it
        compute its prompt itself."""
        connector = self.kv_connector
        released: list[pb.RequestOutput] = []
        if connector is None:
            return released
        connector.observe(runner_output)
        for rid in runner_output.finished_sending:
            if connector.save_finished(rid):
                request = self.finishing.get(rid)
                if request is not None and request.kv_discard_after_save:
                    connector.discard_later(request.kv_save_handle)
                held = self.held_outputs.pop(rid, None)
                if held is not None:
                    released.append(held)
                self._transfer_ended(rid)
        reports = [(rid, True) for rid in runner_output.finished_recving]
        reports += [(rid, False) for rid in runner_output.failed_recving]
        for rid, ok in reports:
            num_loaded = connector.load_finished(rid, ok)
            if num_loaded is None:
                continue
            request = self.waiting_for_remote.pop(rid, None)
            if request is None:
                self._transfer_ended(rid)  # aborted while loading
                continue
            if num_loaded:
                request.num_computed_tokens += num_loaded
                self.kv_cache_manager.cache_full_blocks(request, request.num_computed_tokens)
            else:
                logger.warning("request %s: loading its prompt's KV failed; computing it here", rid)
                self.kv_cache_manager.free(request)
                request.num_computed_tokens = 0
                request.num_cached_tokens = -1
            request.status = RequestStatus.WAITING
            if self.policy == "priority":
                self._enqueue_waiting(request)
            else:
                self.waiting.appendleft(request)
        return released

    def take_held_outputs(self) -> list[pb.RequestOutput]:
        """The held final outputs (the worker failed: their saves will never be reported)."""
        held, self.held_outputs = list(self.held_outputs.values()), {}
        return held

    def forget_worker_state(self) -> None:
        """The worker lost its batch and its KV (it failed, or is a fresh one): abort every
        request first; then nothing needs dropping on the worker and no cached prefix is real."""
        if self.requests or self.held_outputs:
            raise RuntimeError("forget_worker_state with live requests or held outputs: abort or take them first")
        self.worker_known.clear()
        self.finished_req_ids.clear()
        self.deferred_bitmasks.clear()
        for rid in list(self.finishing):  # the worker's transfers are gone with it
            self._transfer_ended(rid)
        if self.kv_connector is not None:
            self.kv_connector.reset()
        self.kv_cache_manager.block_pool.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or transfers the worker has yet to report (it must see steps)."""
        return bool(self.waiting or self.running or self.waiting_for_remote or self.finishing
                    or (self.kv_connector is not None and self.kv_connector.has_pending))

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_for_remote)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ------------------------------------------------------------------ one step

    def _preempt(self, victim: Request) -> None:
        if self.kv_connector is not None and victim.request_id in self.kv_connector.saving:
            # (The worker still reads its blocks: freed now, another request could overwrite them first.)
            raise RuntimeError(f"request {victim.request_id} preempted while its KV save is in flight")
        self.running.remove(victim)
        self.kv_cache_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_output_placeholders = 0  # an in-flight token of a preempted request is dropped
        victim.num_drafts_in_flight = 0
        victim.spec_token_ids = []  # its drafts' slots are gone with its blocks
        victim.num_preemptions += 1
        self.num_preemptions += 1
        if victim.request_id in self.worker_known:
            self.worker_known.discard(victim.request_id)
            self.finished_req_ids.add(victim.request_id)
        if self.policy == "priority":
            self._enqueue_waiting(victim)
        else:
            self.waiting.appendleft(victim)

    def _pick_victim(self, request: Request, idx: int) -> Request | None:
        """Whom to preempt for `request` (running[idx]) to get blocks. FCFS: the last running
        request; priority: lowest priority, latest arrival; never one ranked before `request`.
        Requests whose KV save is in flight are passed over (the worker still reads their blocks).
        None: `request` waits, holding its blocks, rather than preempt itself while transfers in
        flight hold blocks (a save passed over, ended requests in `finishing`): they end within
        steps, and those blocks go back or become preemptable, cheaper than computing `request`
        again, which would only wait for the same blocks."""
        saving = self.kv_connector.saving if self.kv_connector is not None else ()
        if self.policy == "priority":
            key = request.sort_key()
            order = sorted((r for r in self.running if r.sort_key() >= key), key=Request.sort_key, reverse=True)
        else:
            order = reversed(self.running[idx:])
        passed_over = bool(self.finishing)
        for victim in order:
            if victim.request_id in saving:
                passed_over = True
            elif victim is not request or not passed_over:
                return victim
            else:
                return None
        return None

    def schedule(self) -> pb.SchedulerOutput:
        """Decide this step's batch and describe it to the worker incrementally."""
        token_budget = self.max_num_batched_tokens
        scheduled_new: list[tuple[Request, int]] = []
        scheduled_cached: list[tuple[Request, int, list[int]]] = []
        scheduled_ids: set[str] = set()
        preempted = False
        step_bytes = message_limits.finished_ids_bytes(len(self.finished_req_ids))
        self._fill_wait_left = self.step_fill_wait_s
        self._row_waiters = []
        if self._constrained:
            self._end_over_budget()

        # 1) Running requests first: they already hold blocks.
        self._drafts_for_step()
        idx = 0
        while idx < len(self.running) and token_budget > 0:
            request = self.running[idx]
            num_new = min(request.num_tokens_with_spec + request.num_output_placeholders - request.num_computed_tokens,
                          token_budget, self.max_model_len - request.num_computed_tokens)
            if num_new <= 0 or self._finishes_in_flight(request) or self._waits_for_row(request, num_new):
                idx += 1
                continue
            known = request.request_id in self.worker_known
            num_bytes = self._message_bytes(request, num_new, known)
            if (scheduled_new or scheduled_cached) and step_bytes + num_bytes > STEP_BUDGET_BYTES:
                idx += 1  # the next step takes it
                continue
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new + self._lookahead(request, num_new))
                if new_blocks is not None:
                    break
                victim = self._pick_victim(request, idx)
                preempted = True
                if victim is None:
                    break
                if victim is request:
                    self._preempt(request)
                    break
                victim_idx = self.running.index(victim)
                if victim.request_id in scheduled_ids:
                    # Scheduled earlier in this step (priority policy): unschedule it, and drop
                    # the hashes cached for blocks this step would have filled.
                    scheduled_ids.discard(victim.request_id)
                    token_budget += self._unschedule(victim, scheduled_new, scheduled_cached)
                    self.kv_cache_manager.uncache_blocks_from(victim, victim.num_computed_tokens // self.block_size)
                self._preempt(victim)
                if victim_idx < idx:
                    idx -= 1
            if new_blocks is None:
                if victim is None:
                    idx += 1  # `request` waits, holding its blocks, for saves in flight to end
                # else `request` preempted itself; running[idx] is now the next one
                continue
            scheduled_ids.add(request.request_id)
            if known:
                scheduled_cached.append((request, num_new, [b.block_id for b in new_blocks]))
            else:
                scheduled_new.append((request, num_new))
            token_budget -= num_new
            step_bytes += num_bytes
            idx += 1

        # 2) Waiting requests, only if nobody had to be preempted this step. Those whose grammar
        # is still compiling are passed over (they keep their place in the queue).
        skipped: list[Request] = []
        while (not preempted and self.waiting and token_budget > 0
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            if request.grammar is not None and not self._grammar_ready(request):
                self.waiting.popleft()
                if not request.is_finished:
                    skipped.append(request)
                continue
            hit_blocks, num_hit_tokens = [], 0
            if request.needs_prompt_logprobs and self.kv_connector is not None:
                # Every prompt position is computed here: its producer's segment is not needed.
                self.kv_connector.get_num_new_matched_tokens(request, request.num_tokens)
            if request.num_computed_tokens == 0 and not request.needs_prompt_logprobs:
                hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
                if self.kv_connector is not None:
                    num_external = self.kv_connector.get_num_new_matched_tokens(request, num_hit_tokens)
                    if num_external:
                        # At most max_num_seqs loads in flight, each within the step's message.
                        load_bytes = message_limits.kv_transfer_bytes(len(request.request_id),
                                                                      request.num_tokens // self.block_size)
                        if len(self.waiting_for_remote) >= self.max_num_seqs or step_bytes + load_bytes > \
                                STEP_BUDGET_BYTES or not self._wait_for_remote_kvs(request, hit_blocks,
                                                                                   num_hit_tokens, num_external):
                            request.kv_load_decided = False  # (asked again next time)
                            break  # waiting requests wait; they never preempt
                        step_bytes += load_bytes
                        continue
            # (A request whose prompt KV was loaded from a producer has computed tokens already.)
            num_computed = request.num_computed_tokens or num_hit_tokens
            num_new = min(request.num_tokens - num_computed, token_budget)
            if request.grammar is not None and self._waits_for_row(request, num_new, num_computed):
                self.waiting.popleft()
                skipped.append(request)
                continue
            num_bytes = self._message_bytes(request, num_new, known=False)
            if (scheduled_new or scheduled_cached) and step_bytes + num_bytes > STEP_BUDGET_BYTES:
                break  # the next step takes it
            lookahead = self._lookahead(request, num_hit_tokens + num_new)
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new + lookahead, hit_blocks)
            if new_blocks is None:
                break  # waiting requests wait; they never preempt
            self.waiting.popleft()
            if self.kv_cache_manager.enable_prefix_caching and request.num_computed_tokens == 0:  # (not a loaded one)
                self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_hit_tokens)
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled_ids.add(request.request_id)
            scheduled_new.append((request, num_new))
            token_budget -= num_new
            step_bytes += num_bytes
        self.waiting.extendleft(reversed(skipped))

        return self._build_output(scheduled_new, scheduled_cached)

    def _wait_for_remote_kvs(self, request: Request, hit_blocks: list, num_hit_tokens: int,
                             num_external: int) -> bool:
        """Allocate `request`'s blocks for its local hits and the `num_external` tokens its producer
        holds (not cached until loaded) and park it until the worker reports the load; False when
        the pool cannot supply them."""
        if self.kv_cache_manager.allocate_slots(request, num_external, hit_blocks, delay_cache_blocks=True) is None:
            return False
        self.waiting.popleft()
        if self.kv_cache_manager.enable_prefix_caching:
            self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_hit_tokens)
        request.num_computed_tokens = num_hit_tokens
        request.num_cached_tokens = num_hit_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote[request.request_id] = request
        self.kv_connector.update_state_after_alloc(request, self.kv_cache_manager.block_ids(request.request_id),
                                                   num_hit_tokens, num_external)
        return True

    def _max_blocks(self, num_tokens: int) -> int:
        """The most KV blocks a request of `num_tokens` tokens holds (with its lookahead slots)."""
        return (num_tokens + self.num_lookahead_slots) // self.block_size + 2

    def _message_bytes(self, request: Request, num_new: int, known: bool) -> int:
        """At most what scheduling `request` for `num_new` tokens adds to the step's message:
        its full data if the worker does not hold it, else its new block, token and draft ids;
        a bitmask row per sampled position if it is constrained."""
        if known:
            num_ids = self._max_blocks(num_new) + len(request.spec_token_ids)
            if self.pipeline_parallel:
                num_ids += num_new  # the tokens the step computes
            num_bytes = message_limits.cached_request_bytes(len(request.request_id), num_ids)
        else:
            num_bytes = message_limits.new_request_bytes(len(request.request_id), request.num_tokens,
                                                         self._max_blocks(request.num_tokens), request.sampling_bytes)
        if request.grammar is not None:
            num_bytes += self.bitmask_row_bytes * (1 + len(request.spec_token_ids))
        if request.kv_transfer_params is not None and request.kv_transfer_params.do_remote_decode:
            num_bytes += message_limits.kv_transfer_bytes(len(request.request_id),
                                                          request.num_prompt_tokens // self.block_size)  # its save
        return num_bytes

    def drafts_off(self) -> bool:
        """speculative_config.disable_by_batch_size: no drafts while that many requests run."""
        limit = self.speculative_config.disable_by_batch_size if self.speculative_config else 0
        return bool(limit) and len(self.running) >= limit

    def _drafts_for_step(self) -> None:
        """The drafts each running request may bring to this step. Above disable_by_batch_size
        running requests, none (verification costs more than it saves in a large batch); else
        not past what the request may still output. With async scheduling a request whose step
        is in flight cannot know its drafts yet: it holds WORKER_DRAFT placeholders, as many
        as the worker may verify of its own (services/engine/spec_decode.py)."""
        if self.speculative_config is None:
            return
        off = self.drafts_off()
        for request in self.running:
            keep = 0 if off else max_drafts(request, self.max_model_len)
            if request.num_output_placeholders and self.async_scheduling:
                may = may_speculate(request.sampling, request.num_output_tokens)
                request.spec_token_ids = worker_drafts(min(keep, self.speculative_config.num_speculative_tokens)
                                                       if may else 0)
            elif request.spec_token_ids:
                del request.spec_token_ids[keep:]

    def _lookahead(self, request: Request, num_new: int) -> int:
        """Extra KV slots past this step's tokens for a draft model's own draft positions,
        never past max_model_len."""
        if not self.num_lookahead_slots:
            return 0
        return max(min(self.num_lookahead_slots, self.max_model_len - request.num_computed_tokens - num_new), 0)

    def _end_over_budget(self) -> None:
        """End the constrained requests whose grammar work took longer than their budget
        (--structured-outputs-request-timeout) with that error, as a failed compile ends one.
        A token of theirs still in flight is dropped, as an abort's is."""
        now = time.monotonic()
        over = [r for r in self._constrained.values() if r.grammar.over_budget(now)]
        for request in over:
            error = request.grammar.budget_error()
            logger.warning("request %s: %s", request.request_id, error)
            self.abort_requests([request.request_id])
            self.num_grammar_budget_exceeded += 1
            self.failed_outputs.append(pb.RequestOutput(
                request_id=request.request_id, finish_reason="abort", stop_token_id=-1,
                num_prompt_tokens=request.num_prompt_tokens, error_kind=pb.INVALID_REQUEST, error=str(error)))

    def _grammar_ready(self, request: Request) -> bool:
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
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            self.failed_outputs.append(pb.RequestOutput(
                request_id=request.request_id, finish_reason="abort", stop_token_id=-1,
                num_prompt_tokens=request.num_prompt_tokens, error_kind=kind, error=message))
            return False
        return True

    def _waits_for_row(self, request: Request, num_new: int, num_computed: int | None = None) -> bool:
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
        grammar.watch_row(self.structured_output.on_ready if self.structured_output is not None else None)
        self._row_waiters.append(grammar)
        self.num_row_waits += 1
        return True

    def compiling_grammars(self) -> list[RequestGrammar]:
        """Grammars that requests wait for: waiting requests' compiles, and the rows of those
        the last step left out."""
        compiling = [r.grammar for r in self.waiting if r.grammar is not None and r.grammar.is_compiling]
        return compiling + self._row_waiters

    def take_failed_outputs(self) -> list[pb.RequestOutput]:
        failed, self.failed_outputs = self.failed_outputs, []
        return failed

    def _finishes_in_flight(self, request: Request) -> bool:
        """A token already in flight will end `request` by length: scheduling more is waste."""
        if not request.num_output_placeholders:
            return False
        pending = request.num_output_tokens + request.num_output_placeholders
        return pending >= request.max_tokens or request.num_tokens + request.num_output_placeholders >= \
            self.max_model_len

    def _unschedule(self, victim: Request, scheduled_new: list, scheduled_cached: list) -> int:
        for lst in (scheduled_new, scheduled_cached):
            for i, entry in enumerate(lst):
                if entry[0] is victim:
                    del lst[i]
                    return entry[1]
        return 0

    def _build_output(self, scheduled_new: list, scheduled_cached: list) -> pb.SchedulerOutput:
        self.step_id += 1
        out = pb.SchedulerOutput(step_id=self.step_id, skip_drafts=self.drafts_off())
        num_scheduled = []
        for request, num_new in scheduled_new:
            out.new_requests.append(pb.NewRequestData(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling=request.sampling,
                block_ids=self.kv_cache_manager.block_ids(request.request_id),
                num_computed_tokens=request.num_computed_tokens,
                output_token_ids=request.output_token_ids,
                pooling=request.pooling_params,
            ))
            num_scheduled.append(num_new)
            self.worker_known.add(request.request_id)
        for request, num_new, new_block_ids in scheduled_cached:
            start = request.num_computed_tokens
            # Drafts that fit this step's share (a budget cut may leave only some, or none).
            num_spec = max(start + num_new - request.num_tokens - request.num_output_placeholders, 0)
            if num_spec < len(request.spec_token_ids):
                del request.spec_token_ids[num_spec:]
            from_worker = bool(request.spec_token_ids) and request.spec_token_ids[0] == WORKER_DRAFT
            out.cached_requests.append(pb.CachedRequestData(
                request_id=request.request_id,
                new_block_ids=new_block_ids,
                num_computed_tokens=start,
                new_token_ids=request.all_token_ids[start:start + num_new] if self.pipeline_parallel else (),
                spec_token_ids=() if from_worker else request.spec_token_ids,
                num_worker_drafts=len(request.spec_token_ids) if from_worker else 0,
                drafts_in_flight=request.num_drafts_in_flight > 0,
            ))
            num_scheduled.append(num_new)
        out.num_scheduled_tokens.extend(num_scheduled)
        if num_scheduled:
            # Kept for the next real step otherwise: an empty output is never sent.
            out.finished_request_ids.extend(self.finished_req_ids)
            self.finished_req_ids.clear()
        # The worker will compute these tokens: count them as computed now.
        scheduled = [(r, n) for r, n in scheduled_new] + [(r, n) for r, n, _ in scheduled_cached]
        if self.kv_connector is not None:
            for request, num_new in scheduled:  # producer: prompts this step completes are saved after it
                self.kv_connector.request_saves(request, num_new, self.kv_cache_manager.block_ids(request.request_id))
            meta = self.kv_connector.build_connector_meta()
            if meta is not None:
                out.kv_connector_metadata.CopyFrom(meta)
        # Constrained requests whose matcher still waits for a token in flight (async scheduling).
        lagging = any(r.grammar is not None and r.num_output_placeholders for r, _ in scheduled)
        for request, num_new in scheduled:
            request.num_computed_tokens += num_new
            if self.async_scheduling and not request.is_pooling and \
                    request.num_computed_tokens == request.num_tokens_with_spec + request.num_output_placeholders:
                # This step samples tokens we do not know yet: one, plus as many as it has drafts
                # (at most; the rejected ones are given back when its output arrives).
                request.num_output_placeholders += 1 + len(request.spec_token_ids)
                request.num_drafts_in_flight += len(request.spec_token_ids)
        self._attach_bitmask(out, scheduled, lagging)
        return out

    def _attach_bitmask(self, out: pb.SchedulerOutput, scheduled: list[tuple[Request, int]], lagging: bool) -> None:
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
        out.grammar_bitmask = self.structured_output.fill_bitmask([r.grammar for r in constrained])

    def grammar_followup(self, scheduler_output: pb.SchedulerOutput) -> pb.SchedulerOutput | None:
        """For a step sent with `grammar_bitmask_follows`: the message with its bitmask, to send
        once the previous step's tokens are folded in (None for any other step). Requests that
        ended meanwhile get no row (the worker samples them unmasked; their token is dropped)."""
        constrained = self.deferred_bitmasks.pop(scheduler_output.step_id, None)
        if constrained is None:
            return None
        out = pb.SchedulerOutput(step_id=scheduler_output.step_id, grammar_bitmask_only=True)
        live = [r for r in constrained if self.requests.get(r.request_id) is r and r.status == RequestStatus.RUNNING]
        if live:
            self._fill_bitmask(out, live)
        return out

    # ------------------------------------------------------------------ after the step

    def update_from_output(
        self, scheduler_output: pb.SchedulerOutput, runner_output: pb.ModelRunnerOutput
    ) -> list[pb.RequestOutput]:
        """Append sampled tokens, check token-level stops, free finished requests."""
        outputs: list[pb.RequestOutput] = self.take_failed_outputs()
        outputs += self._update_from_kv_xfer_finished(runner_output)
        outputs += self._finish_pooled(runner_output.pooler_output)
        self._gather_prompt_logprobs(runner_output.prompt_logprobs)
        logprobs = runner_output.logprobs
        # Speculative decoding: a request may produce several tokens (accepted drafts + one).
        counts = runner_output.num_sampled_tokens or [1] * len(runner_output.request_ids)
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        drafts = runner_output.spec_token_ids
        num_verified = runner_output.num_draft_tokens
        num_scheduled_drafts = {c.request_id: len(c.spec_token_ids) or c.num_worker_drafts
                                for c in scheduler_output.cached_requests if c.spec_token_ids or c.num_worker_drafts}
        worker_drafted = {c.request_id for c in scheduler_output.cached_requests if c.num_worker_drafts}
        for i, rid in enumerate(runner_output.request_ids):
            request = self.requests.get(rid)
            if request is None or request.is_finished or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            tokens = runner_output.sampled_token_ids[starts[i]:starts[i + 1]]
            num_draft = num_scheduled_drafts.get(rid, 0)
            if request.num_output_placeholders:  # (async scheduling) this step's are now known
                request.num_output_placeholders = max(request.num_output_placeholders - 1 - num_draft, 0)
                request.num_drafts_in_flight = max(request.num_drafts_in_flight - num_draft, 0)
            if num_draft:
                # Rejected drafts' slots are given back: the next step recomputes those positions.
                # (With worker drafts, those it did not have count as rejected.)
                request.num_computed_tokens -= num_draft + 1 - len(tokens)
                # The worker says how many it verified; a worker's own may have been fewer, or none.
                verified = num_verified[i] if i < len(num_verified) else 0 if rid in worker_drafted else num_draft
                if verified:
                    self.spec_stats.observe(verified, len(tokens) - 1)
            new_token_ids: list[int] = []
            status = None
            for token_id in tokens:  # one at a time: a stop ends the request where it would without drafts
                request.append_output_token(token_id)
                new_token_ids.append(token_id)
                status = self._check_stop(request, token_id)
                if request.grammar is not None and status != RequestStatus.FINISHED_STOPPED:
                    status = self._advance_grammar(request, token_id) or status
                if status is not None:
                    break
            request.spec_token_ids = []  # (verified, or worker drafts of a step still in flight)
            if status is None and i < len(drafts) and not request.num_output_placeholders:
                # (With a step of it still in flight the worker keeps these: WORKER_DRAFT.)
                request.spec_token_ids = list(drafts[i].ids)
            if status is None and request.grammar is not None:
                request.grammar.prefetch()  # the next row, filled while the engine gets on with the step
            out = pb.RequestOutput(request_id=rid, new_token_ids=new_token_ids,
                                   num_prompt_tokens=request.num_prompt_tokens,
                                   num_cached_tokens=max(request.num_cached_tokens, 0))
            if logprobs and request.sampling.logprobs >= 0:
                out.logprobs.extend(logprobs[starts[i]:starts[i] + len(new_token_ids)])
            if request.needs_prompt_logprobs:
                out.prompt_logprobs.extend(request.prompt_logprobs)
                request.prompt_logprobs, request.prompt_logprobs_sent = [], True
            if status is not None:
                out.finish_reason = status.finish_reason
                out.stop_token_id = request.stop_token_id
                self.running.remove(request)
                params = self._finish(request, status)
                if params is not None:
                    out.kv_transfer_params.CopyFrom(params)
                    if params.remote_handle and rid in self.finishing:
                        self.held_outputs[rid] = out  # until its save is reported
                        continue
            outputs.append(out)
        return outputs

    def _finish_pooled(self, pooler_output) -> list[pb.RequestOutput]:
        """Pooling requests whose prompt the step completed: each ends ("stop") with its
        embedding, and its blocks are freed (vLLM: a pooler output finishes the request)."""
        outputs = []
        for pooled in pooler_output:
            request = self.requests.get(pooled.request_id)
            if request is None or not request.is_pooling or request.status != RequestStatus.RUNNING \
                    or request.num_computed_tokens < request.num_tokens:
                continue  # aborted (or preempted) while the step ran
            outputs.append(pb.RequestOutput(request_id=request.request_id, finish_reason="stop", stop_token_id=-1,
                                            num_prompt_tokens=request.num_prompt_tokens,
                                            pooled_output=pooled.embedding))
            self.running.remove(request)
            self._finish(request, RequestStatus.FINISHED_STOPPED)
        return outputs

    def _gather_prompt_logprobs(self, chunks) -> None:
        """File each step's prompt logprobs by position (a preempted request recomputes its
        prompt and simply overwrites the same positions)."""
        for chunk in chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or not request.needs_prompt_logprobs:
                continue
            start = chunk.first_position - 1
            request.prompt_logprobs[start:start + len(chunk.logprobs)] = list(chunk.logprobs)

    def _advance_grammar(self, request: Request, token_id: int) -> RequestStatus | None:
        """Feed the sampled token to the request's matcher: a finished grammar ends the request
        with `stop` (as does a token the grammar refuses, which only an all-banned row yields)."""
        if not request.grammar.accept(token_id):
            logger.warning("request %s: token %d is outside its grammar; stopping it", request.request_id, token_id)
            return RequestStatus.FINISHED_STOPPED
        if request.grammar.is_terminated:
            return RequestStatus.FINISHED_STOPPED
        return None

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        if request.num_output_tokens >= request.min_tokens and (
                token_id in request.eos_token_ids or token_id in request.stop_token_ids):
            request.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def stats(self) -> dict[str, float]:
        kv = self.kv_cache_manager
        return {
            "num_free_blocks": kv.block_pool.num_free_blocks,
            "num_total_blocks": kv.block_pool.num_blocks - 1,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_preemptions": self.num_preemptions,
            "num_waiting": self.num_waiting,
            "num_running": self.num_running,
            "kv_cache_usage": kv.usage,
            **self.spec_stats.as_dict(),
            **(self.kv_connector.stats() if self.kv_connector is not None else {}),
        }
