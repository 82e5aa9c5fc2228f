"""EngineCore: the scheduler's side of one engine step, shared by the offline LLM and the
scheduler service. It turns GenerateRequests into scheduled batches and folds the
worker's sampled tokens back into per-request outputs; who carries the batch to the
worker (a direct call or a gRPC stream) is the caller's business.
"""

from __future__ import annotations

from services.common.config import VllmConfig, kv_tier_medium
from services.common.kv_transfer_params import check_params
from services.common.message_limits import MAX_LORA_NAME_CHARS, MAX_LORA_PATH_CHARS
from services.common.metric_buckets import ITERATION_TOKENS_BUCKETS, BucketCounts
from services.common.pooling_config import GENERATE_ONLY_MESSAGE, POOLING_ONLY_MESSAGE, dimensions_error
from services.common.proto import myvllm_pb2 as pb
from services.engine.kv_tier import KVTierScheduler
from services.engine.lora_slots import lora_adapters
from services.engine.request import Request
from services.engine.request_limits import InvalidRequest, validate_generate_request
from services.engine.scheduler import Scheduler
from services.engine.step_pace import StepPace, prompt_positions
from services.engine.structured_output import RequestGrammar, StructuredOutputManager


class EngineCore:
    def __init__(self, config: VllmConfig, model_info: pb.ModelInfo, num_blocks: int,
                 kv_producer_address: str | None = None) -> None:
        """`kv_producer_address`: where other engines' workers reach this engine's worker
        (GrpcConnector producers: the params of its saved prompts say it)."""
        self.config = config
        config.resolve_async_scheduling(model_info.device)
        self.model_info = model_info
        self.max_model_len = model_info.max_model_len
        self.eos_token_ids = frozenset(model_info.eos_token_ids)
        sched = config.scheduler_config
        self.structured_output = StructuredOutputManager(
            config.model_config.model, model_info.vocab_size, model_info.eos_token_ids, sched.max_num_seqs,
            compile_timeout_s=config.structured_outputs_config.compile_timeout_s,
            request_timeout_s=config.structured_outputs_config.request_timeout_s)
        self.scheduler = Scheduler(config, num_blocks, self.max_model_len, self.structured_output,
                                   kv_producer_address)
        tier = self.scheduler.kv.connector
        if isinstance(tier, KVTierScheduler):  # (the worker picks its storage by the same rule)
            tier.medium = kv_tier_medium(model_info.device, config.cache_config.kv_offloading_dir)
        self.num_steps = 0
        self.num_dummy_steps = 0  # lockstep steps with nothing scheduled (services/engine/step_loop.py)
        self.iteration_tokens = BucketCounts(ITERATION_TOKENS_BUCKETS)  # tokens per step
        self.pace = StepPace()  # step time and prefill rate, published with the load for routing

    def add_request(self, req: pb.GenerateRequest) -> None:
        """Queue a request; raises ValueError (InvalidRequest for a bad request) with a clear
        message if it cannot run."""
        self._check_runner(req)
        validate_generate_request(req, self.model_info.vocab_size, self.max_model_len)
        prompt = list(req.prompt_token_ids)
        if req.HasField("pooling"):
            # A prompt-only request: no output tokens, so it holds KV for its prompt alone. Its
            # sampling settings are ignored (never checked, never sent to the worker).
            self.scheduler.add_request(Request(
                req.request_id, prompt, pb.SamplingParams(), self.eos_token_ids, max_tokens=0, priority=req.priority,
                cache_salt=req.cache_salt, pooling_params=req.pooling))
            return
        # Absent: vLLM's default, whatever context the prompt leaves.
        room = self.max_model_len - len(prompt)
        max_tokens = req.sampling.max_tokens if req.sampling.HasField("max_tokens") else room
        resumed = list(req.resumed_output_token_ids)
        self._check_resumed(resumed, max_tokens)
        kv_params = self._check_kv_transfer_params(req)
        request = Request(
            req.request_id, prompt, req.sampling, self.eos_token_ids, max_tokens=max_tokens,
            priority=req.priority, cache_salt=req.cache_salt, resumed_output_token_ids=resumed,
            kv_transfer_params=kv_params, lora_request=self._check_lora_request(req))
        if req.sampling.HasField("structured_outputs"):
            # Parsed and compiled in the background, within --structured-outputs-compile-timeout (the
            # request waits for it, the batch does not).
            request.grammar = self.structured_output.grammar_for(req.sampling.structured_outputs)
        self.scheduler.add_request(request)

    def _check_lora_request(self, req: pb.GenerateRequest) -> pb.LoRARequest | None:
        """The request's adapter, where LoRA is on and the adapter is named whole (vLLM's
        LoRARequest fields); the worker reads and checks the adapter itself."""
        if not req.HasField("lora_request"):
            return None
        lora = req.lora_request
        if not self.config.lora_config.enable_lora:
            raise InvalidRequest(f"LoRA adapter {lora.lora_name[:100]!r} requested, but this engine serves no "
                                 "adapters (start it with --enable-lora)")
        if not lora.lora_name or len(lora.lora_name) > MAX_LORA_NAME_CHARS:
            raise InvalidRequest(f"lora_request.lora_name must be 1 to {MAX_LORA_NAME_CHARS} characters")
        if lora.lora_int_id < 1:
            raise InvalidRequest(f"lora_request.lora_int_id must be >= 1, got {lora.lora_int_id}")
        if not lora.lora_path or len(lora.lora_path) > MAX_LORA_PATH_CHARS:
            raise InvalidRequest(f"lora_request.lora_path must be 1 to {MAX_LORA_PATH_CHARS} characters")
        return lora

    def _check_runner(self, req: pb.GenerateRequest) -> None:
        """A pooling engine serves embedding requests only, a generate engine none (vLLM's rule);
        `dimensions` only where the model allows them."""
        pooling = self.config.model_config.runner == "pooling"
        if req.HasField("pooling") != pooling:
            raise InvalidRequest(POOLING_ONLY_MESSAGE if pooling else GENERATE_ONLY_MESSAGE)
        if pooling:
            info = self.model_info
            error = dimensions_error(req.pooling.dimensions, info.hidden_size, info.is_matryoshka,
                                     list(info.matryoshka_dimensions))
            if error is not None:
                raise InvalidRequest(error)

    def _check_kv_transfer_params(self, req: pb.GenerateRequest) -> pb.KVTransferParams | None:
        """A request's kv_transfer_params, if any: well formed, and for a role this engine plays."""
        if not req.HasField("kv_transfer_params"):
            return None
        params = req.kv_transfer_params
        try:
            check_params(params)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        kv = self.config.kv_transfer_config
        if params.do_remote_decode and (kv is None or not kv.is_producer):
            raise InvalidRequest("kv_transfer_params.do_remote_decode needs an engine started with "
                                 "--kv-transfer-config kv_role kv_producer or kv_both")
        if params.do_remote_prefill and (kv is None or not kv.is_consumer):
            raise InvalidRequest("kv_transfer_params.do_remote_prefill needs an engine started with "
                                 "--kv-transfer-config kv_role kv_consumer or kv_both")
        if params.do_remote_prefill:
            try:
                self.scheduler.kv.connector.check_source(params)
            except ValueError as e:
                raise InvalidRequest(str(e)) from None
        return params if params.do_remote_decode or params.do_remote_prefill else None

    def _check_resumed(self, resumed: list[int], max_tokens: int) -> None:
        """A migrated request must still have something left to generate."""
        bad = [t for t in resumed if not 0 <= t < self.model_info.vocab_size]
        if bad:
            raise ValueError(f"resumed output token id {bad[0]} is out of range [0, {self.model_info.vocab_size})")
        if len(resumed) >= max_tokens:
            raise ValueError(f"request already has {len(resumed)} output tokens; max_tokens is {max_tokens}")

    def abort(self, request_ids: list[str]) -> list[pb.RequestOutput]:
        return [pb.RequestOutput(request_id=r.request_id, finish_reason="abort",
                                 num_prompt_tokens=r.num_prompt_tokens, stop_token_id=-1)
                for r in self.scheduler.abort_requests(request_ids)]

    def fail_all(self, message: str, kind: int = pb.ENGINE_FAULT) -> list[pb.RequestOutput]:
        """The worker failed: end every request with `message` and start from a clean slate
        (no request state on the worker, no prefix-cache entry whose KV may be missing)."""
        outputs = self.abort(list(self.scheduler.requests))
        for held in self.scheduler.take_held_outputs():  # their segments may never be whole
            outputs.append(pb.RequestOutput(request_id=held.request_id, finish_reason="abort",
                                            num_prompt_tokens=held.num_prompt_tokens, stop_token_id=-1))
        for out in outputs:
            out.error, out.error_kind = message, kind
        self.scheduler.forget_worker_state()
        self.pace.forget_in_flight()
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def schedule(self) -> pb.SchedulerOutput:
        out = self.scheduler.schedule()
        if out.num_scheduled_tokens:
            self.iteration_tokens.observe(sum(out.num_scheduled_tokens))
            self.pace.scheduled(out.step_id, self._prompt_positions(out))
        return out

    def _prompt_positions(self, so: pb.SchedulerOutput) -> int:
        """Prompt tokens among what `so` computes (its new requests come first, then the cached)."""
        steps = [*so.new_requests, *so.cached_requests]
        requests = self.scheduler.requests
        return prompt_positions([r.num_computed_tokens for r in steps], so.num_scheduled_tokens,
                                [requests[r.request_id].num_prompt_tokens if r.request_id in requests else 0
                                 for r in steps])

    def grammar_followup(self, so: pb.SchedulerOutput) -> pb.SchedulerOutput | None:
        """The bitmask message a step in flight waits for, once the step before it is processed."""
        return self.scheduler.grammar_followup(so)

    def compiling_grammars(self) -> list[RequestGrammar]:
        """Grammars whose compile or allowed-token row requests wait for (nothing to schedule may
        mean: wait for these)."""
        return self.scheduler.compiling_grammars()

    def take_failed_outputs(self) -> list[pb.RequestOutput]:
        """Requests ended outside a step (a grammar that failed or timed out compiling)."""
        return self.scheduler.take_failed_outputs()

    def process(self, so: pb.SchedulerOutput, runner_output: pb.ModelRunnerOutput) -> list[pb.RequestOutput]:
        if runner_output.error:
            raise RuntimeError(f"worker failed: {runner_output.error}")
        self.num_steps += 1
        self.pace.processed(so.step_id)
        self.scheduler.counters.cudagraph_capture_failures += runner_output.cudagraph_capture_failures
        return self.scheduler.update_from_output(so, runner_output)

    def stats(self) -> pb.Stats:
        s = self.scheduler.stats()
        running_loras, waiting_loras = lora_adapters(self.scheduler.running, self.scheduler.waiting)
        info = self.model_info
        c = self.config
        return pb.Stats(max_model_len=self.max_model_len, model=c.model_config.model,
                        block_size=c.cache_config.block_size, num_steps=self.num_steps, dtype=info.dtype,
                        attention_backend=info.attention_backend, max_num_seqs=c.scheduler_config.max_num_seqs,
                        runner=c.model_config.runner,
                        max_num_batched_tokens=c.scheduler_config.max_num_batched_tokens,
                        grammar_compiles=self.structured_output.num_compiles,
                        grammar_compile_seconds=self.structured_output.compile_seconds,
                        grammar_cache_hits=self.structured_output.cache_hits,
                        grammar_compile_timeouts=self.structured_output.num_compile_timeouts,
                        grammar_row_waits=self.scheduler.grammar.num_row_waits,
                        num_dummy_steps=self.num_dummy_steps,
                        iteration_tokens_counts=self.iteration_tokens.counts,
                        iteration_tokens_sum=int(self.iteration_tokens.sum),
                        spec_decode_enabled=c.speculative_config is not None,
                        enable_prefix_caching=self.scheduler.kv_cache_manager.enable_prefix_caching,
                        running_lora_adapters=running_loras, waiting_lora_adapters=waiting_loras,
                        max_lora=c.lora_config.max_loras if c.lora_config.enable_lora else 0,
                        max_lora_rank=c.lora_config.max_lora_rank, **s)

    def load(self) -> pb.Load:
        s = self.scheduler
        kv = self.config.kv_transfer_config
        return pb.Load(num_waiting=s.num_waiting, num_running=s.num_running, kv_cache_usage=s.kv_cache_manager.usage,
                       kv_role=kv.kv_role if kv is not None else "",
                       prefill_tokens_per_s=self.pace.prefill_tokens_per_s, step_s=self.pace.step_s)
