"""The scheduler: one token budget per step, running requests first, then waiting ones.

There is no prefill or decode phase. Each request needs `num_tokens - num_computed_tokens`
more tokens computed; a long prompt is cut into chunks by the budget (chunked prefill)
while decodes of other requests continue in the same step. When the block pool runs dry,
running requests are preempted by recompute: their blocks are freed and they go back to
the head of the waiting queue (the prefix cache usually hands most blocks back later).

Features hook into the loop at named points, each through one object that is inert when the
feature is off: `grammar` (structured outputs: sched_grammar.py), `spec` (speculative
decoding: spec_decode.py), `kv` (prefill/decode disaggregation: sched_kv_transfer.py), `lora`
(the adapters' slots: lora_slots.py).
"""

from __future__ import annotations

import itertools
import time
from collections import deque

from services.common import message_limits
from services.common.config import VllmConfig
from services.common.proto import myvllm_pb2 as pb
from services.engine.engine_counters import EngineCounters
from services.engine.kv_cache_manager import KVCacheManager
from services.engine.lora_slots import LoraSlots, fail_lora_loads
from services.engine.prompt_logprobs import gather_prompt_logprobs
from services.engine.request import Request, RequestStatus
from services.engine.request_limits import check_request_fits
from services.engine.sched_grammar import GrammarHooks
from services.engine.sched_kv_transfer import KVTransferHooks
from services.engine.sched_pooling import finish_pooled
from services.engine.spec_decode import SpecDecodeHooks
from services.engine.step_plan import StepPlan, StepSizer, cached_request_data, new_request_data
from services.engine.stop_check import append_output_tokens
from services.engine.structured_output import RequestGrammar, StructuredOutputManager


class Scheduler:
    """Owns the waiting/running queues and every request's KV blocks."""

    def __init__(self, config: VllmConfig, num_blocks: int, max_model_len: int,
                 structured_output: StructuredOutputManager | None = None,
                 kv_producer_address: str | None = None) -> None:
        """`structured_output`: grammars and bitmasks (None: no request may be constrained);
        `kv_producer_address`: where consumers reach this engine's worker (GrpcConnector)."""
        sched, cache = config.scheduler_config, config.cache_config
        self.block_size = cache.block_size
        self.max_num_seqs = sched.max_num_seqs
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = sched.scheduling_policy
        # With async scheduling step N+1 is scheduled before step N's tokens are back.
        self.async_scheduling = bool(sched.async_scheduling)
        # With pipeline parallelism the first stage never sees sampled tokens: cached requests carry the
        # tokens each step computes (a decode in flight waits for its token: num_computed == num_tokens).
        self.pipeline_parallel = config.parallel_config.pipeline_parallel_size > 1
        self.kv_cache_manager = KVCacheManager(num_blocks, self.block_size, cache.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Ids the worker must drop at the next step (finished, aborted or preempted).
        self.finished_req_ids: set[str] = set()
        # Requests whose state the worker holds (scheduled since their last preemption).
        self.worker_known: set[str] = set()
        self.counters = EngineCounters()
        self.step_id = 0
        self.grammar = GrammarHooks(structured_output, self.abort_requests, self._finish)
        self.spec = SpecDecodeHooks(config.speculative_config, max_model_len, self.async_scheduling)
        self.kv = KVTransferHooks(config.kv_transfer_config, self.kv_cache_manager, self._requeue,
                                  kv_producer_address, config.kv_offloading)
        self.lora = LoraSlots(config.lora_config.max_loras if config.lora_config.enable_lora else 0)
        self.sizer = StepSizer(self.block_size, self.spec.num_lookahead_slots, self.grammar.row_bytes,
                               self.pipeline_parallel,
                               message_limits.lora_request_bytes() if self.lora.max_loras else 0)
        self.sizer.check(max_model_len, self.spec.num_drafts)

    # ------------------------------------------------------------------ queue management

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self.kv.finishing:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        capacity = (self.kv_cache_manager.block_pool.num_blocks - 1) * self.block_size
        check_request_fits(request, self.max_model_len, capacity, self.spec.num_lookahead_slots)
        self.requests[request.request_id] = request
        if request.grammar is not None:
            self.grammar.constrained[request.request_id] = request
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

    def _requeue(self, request: Request) -> None:
        """Back to the head of the waiting queue (its place by priority under that policy)."""
        if self.policy == "priority":
            self._enqueue_waiting(request)
        else:
            self.waiting.appendleft(request)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        """Finish the given requests as aborted; returns those that were live."""
        aborted = []
        for rid in request_ids:
            held = self.kv.abort_held(rid)  # ended; its save not yet reported
            if held is not None:
                aborted.append(held)
                continue
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self.kv.waiting_for_remote[rid]
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
        self.lora.give_back(request)
        params = self.kv.finish(request, status == RequestStatus.FINISHED_ABORTED)
        del self.requests[request.request_id]
        self.grammar.constrained.pop(request.request_id, None)
        if request.request_id in self.worker_known:
            self.worker_known.discard(request.request_id)
            self.finished_req_ids.add(request.request_id)
        return params

    def take_held_outputs(self) -> list[pb.RequestOutput]:
        """The held final outputs (the worker failed: their saves will never be reported)."""
        return self.kv.take_held_outputs()

    def take_failed_outputs(self) -> list[pb.RequestOutput]:
        return self.grammar.take_failed_outputs()

    def compiling_grammars(self) -> list[RequestGrammar]:
        return self.grammar.compiling(self.waiting)

    def grammar_followup(self, scheduler_output: pb.SchedulerOutput) -> pb.SchedulerOutput | None:
        return self.grammar.followup(scheduler_output, self.requests)

    def forget_worker_state(self) -> None:
        """The worker lost its batch and its KV (it failed, or is a fresh one): abort every
        request first; then nothing needs dropping on the worker and no cached prefix is real."""
        if self.requests or self.kv.held_outputs:
            raise RuntimeError("forget_worker_state with live requests or held outputs: abort or take them first")
        self.worker_known.clear()
        self.finished_req_ids.clear()
        self.grammar.deferred_bitmasks.clear()
        self.kv.reset()
        self.kv_cache_manager.block_pool.reset_prefix_cache()
        self.lora.forget()

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or transfers the worker has yet to report (it must see steps)."""
        return bool(self.waiting or self.running) or self.kv.has_pending

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.kv.waiting_for_remote)

    @property
    def num_waiting_deferred(self) -> int:
        """Of num_waiting, those awaiting their grammar or a producer's KV (vLLM's "deferred")."""
        return self.grammar.num_compiling(self.waiting) + len(self.kv.waiting_for_remote)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ------------------------------------------------------------------ one step

    def _preempt(self, victim: Request) -> None:
        if victim.request_id in self.kv.saving:
            # (The worker still reads its blocks: freed now, another request could overwrite them first.)
            raise RuntimeError(f"request {victim.request_id} preempted while its KV save is in flight")
        self.running.remove(victim)
        self.kv_cache_manager.free(victim)
        self.lora.give_back(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_output_placeholders = 0  # an in-flight token of a preempted request is dropped
        victim.num_drafts_in_flight = 0
        victim.spec_token_ids = []  # its drafts' slots are gone with its blocks
        victim.num_preemptions += 1
        self.counters.num_preemptions += 1
        if victim.request_id in self.worker_known:
            self.worker_known.discard(victim.request_id)
            self.finished_req_ids.add(victim.request_id)
        self._requeue(victim)

    def _pick_victim(self, request: Request, idx: int) -> Request | None:
        """Whom to preempt for `request` (running[idx]) to get blocks. FCFS: the last running
        request; priority: lowest priority, latest arrival; never one ranked before `request`.
        Requests whose KV save is in flight are passed over (the worker still reads their blocks).
        None: `request` waits, holding its blocks, rather than preempt itself while transfers in
        flight hold blocks (a save passed over, ended requests in `finishing`): they end within
        steps, and those blocks go back or become preemptable, cheaper than computing `request`
        again, which would only wait for the same blocks."""
        saving = self.kv.saving
        if self.policy == "priority":
            key = request.sort_key()
            order = sorted((r for r in self.running if r.sort_key() >= key), key=Request.sort_key, reverse=True)
        else:
            order = reversed(self.running[idx:])
        passed_over = bool(self.kv.finishing)
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
        plan = StepPlan(self.max_num_batched_tokens, message_limits.finished_ids_bytes(len(self.finished_req_ids)))
        self.grammar.begin_step()
        self.spec.drafts_for_step(self.running)
        self._schedule_running(plan)
        if not plan.preempted:  # waiting requests only if nobody had to be preempted
            self._schedule_waiting(plan)
        return self._build_output(plan)

    def _schedule_running(self, plan: StepPlan) -> None:
        """Running requests first: they already hold blocks."""
        idx = 0
        while idx < len(self.running) and plan.token_budget > 0:
            request = self.running[idx]
            num_new = min(request.num_tokens_with_spec + request.num_output_placeholders - request.num_computed_tokens,
                          plan.token_budget, self.max_model_len - request.num_computed_tokens)
            if num_new <= 0 or self._finishes_in_flight(request) or self.grammar.waits_for_row(request, num_new):
                idx += 1
                continue
            known = request.request_id in self.worker_known
            num_bytes = self.sizer.request_bytes(request, num_new, known)
            if not plan.fits(num_bytes):
                idx += 1  # the next step takes it
                continue
            new_blocks, idx = self._allocate_running(request, idx, num_new, plan)
            if new_blocks is None:
                continue
            plan.add(request, num_new, num_bytes, [b.block_id for b in new_blocks] if known else None)
            idx += 1

    def _allocate_running(self, request: Request, idx: int, num_new: int, plan: StepPlan) -> tuple[list | None, int]:
        """Blocks for running[idx]'s `num_new` tokens, preempting others (or itself) while the pool
        is short: (its new blocks or None, the index the loop goes on from)."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new + self.spec.lookahead(request, num_new))
            if new_blocks is not None:
                return new_blocks, idx
            victim = self._pick_victim(request, idx)
            plan.preempted = True
            if victim is None:
                return None, idx + 1  # `request` waits, holding its blocks, for saves in flight to end
            if victim is request:
                self._preempt(request)
                return None, idx  # running[idx] is now the next one
            victim_idx = self.running.index(victim)
            if victim.request_id in plan.ids:
                # Scheduled earlier in this step (priority policy): unschedule it, and drop the
                # hashes cached for blocks this step would have filled.
                plan.unschedule(victim)
                self.kv_cache_manager.uncache_blocks_from(victim, victim.num_computed_tokens // self.block_size)
            self._preempt(victim)
            if victim_idx < idx:
                idx -= 1

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Waiting requests, while the budget and batch slots last; they never preempt. Those whose
        grammar is still compiling (or row not filled) are passed over and keep their place."""
        skipped: list[Request] = []
        while self.waiting and plan.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.grammar is not None and not self.grammar.ready(request):
                self.waiting.popleft()
                if not request.is_finished:
                    skipped.append(request)
                continue
            hit_blocks, num_hit_tokens = [], 0
            connector = self.kv.connector
            if request.needs_prompt_logprobs and connector is not None:
                # Every prompt position is computed here: its producer's segment is not needed.
                connector.get_num_new_matched_tokens(request, request.num_tokens)
            if request.num_computed_tokens == 0 and not request.needs_prompt_logprobs:
                hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
                if connector is not None:
                    load_bytes = self.kv.try_remote_load(request, hit_blocks, num_hit_tokens, plan.step_bytes,
                                                         self.max_num_seqs)
                    if load_bytes == 0:
                        break  # its load waits, and so does the queue behind it
                    if load_bytes is not None:  # parked until its load is reported
                        self.waiting.popleft()
                        plan.step_bytes += load_bytes
                        continue
            # (A request whose prompt KV was loaded from a producer has computed tokens already.)
            num_computed = request.num_computed_tokens or num_hit_tokens
            num_new = min(request.num_tokens - num_computed, plan.token_budget)
            if request.grammar is not None and self.grammar.waits_for_row(request, num_new, num_computed):
                self.waiting.popleft()
                skipped.append(request)
                continue
            num_bytes = self.sizer.request_bytes(request, num_new, known=False)
            if not plan.fits(num_bytes):
                break  # the next step takes it
            if not self.lora.take(request):  # every slot runs other adapters: base requests go on
                self.waiting.popleft()
                skipped.append(request)
                continue
            lookahead = self.spec.lookahead(request, num_hit_tokens + num_new)
            if self.kv_cache_manager.allocate_slots(request, num_new + lookahead, hit_blocks) is None:
                self.lora.give_back(request)
                break
            self.waiting.popleft()
            self._admit(request, num_hit_tokens, num_computed)
            plan.add(request, num_new, num_bytes)
        self.waiting.extendleft(reversed(skipped))

    def _admit(self, request: Request, num_hit_tokens: int, num_computed: int) -> None:
        if self.kv_cache_manager.enable_prefix_caching and request.num_computed_tokens == 0:  # (not a loaded one)
            self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_hit_tokens)
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING
        if request.scheduled_time is None:
            request.scheduled_time = time.monotonic()
        self.running.append(request)

    def _finishes_in_flight(self, request: Request) -> bool:
        """A token already in flight will end `request` by length: scheduling more is waste."""
        if not request.num_output_placeholders:
            return False
        pending = request.num_output_tokens + request.num_output_placeholders
        return pending >= request.max_tokens or request.num_tokens + request.num_output_placeholders >= \
            self.max_model_len

    def _build_output(self, plan: StepPlan) -> pb.SchedulerOutput:
        self.step_id += 1
        out = pb.SchedulerOutput(step_id=self.step_id, skip_drafts=self.spec.drafts_off(len(self.running)))
        for request, _ in plan.new:
            out.new_requests.append(new_request_data(request, self.kv_cache_manager.block_ids(request.request_id)))
            self.worker_known.add(request.request_id)
        for request, num_new, new_block_ids in plan.cached:
            out.cached_requests.append(cached_request_data(request, num_new, new_block_ids, self.pipeline_parallel))
        num_scheduled = [n for _, n in plan.new] + [n for _, n, _ in plan.cached]
        out.num_scheduled_tokens.extend(num_scheduled)
        if num_scheduled:
            # Kept for the next real step otherwise: an empty output is never sent.
            out.finished_request_ids.extend(self.finished_req_ids)
            self.finished_req_ids.clear()
        # The worker will compute these tokens: count them as computed now.
        scheduled = plan.scheduled
        self.kv.after_step(out, scheduled)
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
        self.grammar.attach_bitmask(out, scheduled, lagging)
        return out

    # ------------------------------------------------------------------ after the step

    def update_from_output(
        self, scheduler_output: pb.SchedulerOutput, runner_output: pb.ModelRunnerOutput
    ) -> list[pb.RequestOutput]:
        """Append sampled tokens, check token-level stops, free finished requests."""
        outputs: list[pb.RequestOutput] = self.grammar.take_failed_outputs()
        outputs += fail_lora_loads(runner_output.lora_load_failures, self)
        outputs += self.kv.update_from_output(runner_output)
        outputs += finish_pooled(runner_output.pooler_output, self.requests, self._end_pooled)
        gather_prompt_logprobs(runner_output.prompt_logprobs, self.requests)
        # Speculative decoding: a request may produce several tokens (accepted drafts + one).
        counts = runner_output.num_sampled_tokens or [1] * len(runner_output.request_ids)
        starts = list(itertools.accumulate(counts, initial=0))
        drafts = self.spec.step_drafts(scheduler_output, runner_output)
        for i, rid in enumerate(runner_output.request_ids):
            request = self.requests.get(rid)
            if request is None or request.is_finished or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            tokens = runner_output.sampled_token_ids[starts[i]:starts[i + 1]]
            drafts.settle(i, request, len(tokens))
            new_token_ids, status = append_output_tokens(request, tokens, self.max_model_len,
                                                         self.grammar.advance)
            drafts.next_drafts(i, request, status is not None)
            self.counters.count_output(request, new_token_ids)
            if status is None and request.grammar is not None:
                request.grammar.prefetch()  # the next row, filled while the engine gets on with the step
            out = pb.RequestOutput(request_id=rid, new_token_ids=new_token_ids,
                                   num_prompt_tokens=request.num_prompt_tokens,
                                   num_cached_tokens=max(request.num_cached_tokens, 0))
            if runner_output.logprobs and request.sampling.logprobs >= 0:
                out.logprobs.extend(runner_output.logprobs[starts[i]:starts[i] + len(new_token_ids)])
            if request.needs_prompt_logprobs:
                out.prompt_logprobs.extend(request.prompt_logprobs)
                request.prompt_logprobs, request.prompt_logprobs_sent = [], True
            if status is None or not self._end_with(request, status, out):
                outputs.append(out)
        return outputs

    def _end_with(self, request: Request, status: RequestStatus, out: pb.RequestOutput) -> bool:
        """End `request` with its final output `out`; True if that output is held (a producer's,
        until its save is reported)."""
        out.finish_reason = status.finish_reason
        out.stop_token_id = request.stop_token_id
        out.timings.CopyFrom(request.timings())
        self.running.remove(request)
        params = self._finish(request, status)
        if params is None:
            return False
        out.kv_transfer_params.CopyFrom(params)
        return self.kv.hold(out, params)

    def _end_pooled(self, request: Request) -> None:
        self.running.remove(request)
        self._finish(request, RequestStatus.FINISHED_STOPPED)

    def stats(self) -> dict[str, float]:
        kv = self.kv_cache_manager
        return {"num_free_blocks": kv.block_pool.num_free_blocks, "num_total_blocks": kv.block_pool.num_blocks - 1,
                "prefix_cache_queries": kv.prefix_cache_queries, "prefix_cache_hits": kv.prefix_cache_hits,
                **self.counters.as_dict(), "num_waiting": self.num_waiting,
                "num_waiting_deferred": self.num_waiting_deferred, "num_running": self.num_running,
                "kv_cache_usage": kv.usage, **self.spec.stats.as_dict(), **self.kv.stats()}
