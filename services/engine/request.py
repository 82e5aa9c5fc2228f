"""The scheduler's view of one request: token ids and the counters that drive scheduling."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from services.common.proto import myvllm_pb2 as pb

if TYPE_CHECKING:
    from services.engine.structured_output import RequestGrammar


class RequestStatus(enum.IntEnum):
    # P/D disaggregation: the request holds blocks its producer's KV is being loaded into; it is
    # not scheduled until the worker reports the load (services/engine/kv_connector.py).
    WAITING_FOR_REMOTE_KVS = -1
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self, "")


class Request:
    """A request inside the scheduler.

    `num_computed_tokens` chases `num_tokens` (prompt + generated so far): there is no
    prefill or decode phase, only how far behind the KV cache is.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: pb.SamplingParams,
        eos_token_ids: frozenset[int],
        max_tokens: int,
        priority: int = 0,
        cache_salt: str = "",
        arrival_time: float | None = None,
        resumed_output_token_ids: list[int] | None = None,
        pooling_params: pb.PoolingParams | None = None,
        kv_transfer_params: pb.KVTransferParams | None = None,
        lora_request: pb.LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        # A migrated request arrives with the tokens it generated on a failed replica: like a
        # preempted request's outputs they count for max_tokens, min_tokens and penalties,
        # are recomputed with the prompt, and are never sent back.
        self.output_token_ids: list[int] = list(resumed_output_token_ids or [])
        self.all_token_ids: list[int] = list(prompt_token_ids) + self.output_token_ids
        self.sampling = sampling
        self.sampling_bytes = sampling.ByteSize()  # its share of the step that first sends it
        self.eos_token_ids = frozenset() if sampling.ignore_eos else eos_token_ids
        self.stop_token_ids = frozenset(sampling.stop_token_ids)
        self.max_tokens = max_tokens
        self.min_tokens = sampling.min_tokens
        self.priority = priority
        self.cache_salt = cache_salt
        # LoRA: the adapter it runs with (None: the base model), and the worker slot it holds while
        # running (services/engine/lora_slots.py).
        self.lora_request = lora_request
        self.lora_slot: int | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Speculative decoding: draft tokens proposed for this request's next positions, to be
        # verified by the next step that schedules it (never counted in num_tokens).
        self.spec_token_ids: list[int] = []
        # Async scheduling: tokens being sampled by steps still in flight (not yet appended).
        self.num_output_placeholders = 0
        # Async scheduling with speculative decoding: drafts those steps verify (their rejected
        # ones are counted as computed until the output says otherwise).
        self.num_drafts_in_flight = 0
        self.num_cached_tokens = -1  # prompt tokens hit in the prefix cache at first schedule
        self.num_preemptions = 0
        self.stop_token_id = -1
        # When it was first scheduled and got its first output token (monotonic; vLLM's request
        # queue / prefill / decode / inference times are measured from these and arrival_time).
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        # Chained hashes of this request's full blocks, extended as tokens arrive.
        self.block_hashes: list[bytes] = []
        # Prompt logprobs (positions 1..n-1), gathered from the steps that compute the prompt
        # and sent with the first output; None when not asked for.
        self.prompt_logprobs: list | None = (
            [None] * (len(prompt_token_ids) - 1) if sampling.HasField("prompt_logprobs") else None)
        self.prompt_logprobs_sent = False
        # Structured outputs: the request's grammar and matcher (None: unconstrained).
        self.grammar: RequestGrammar | None = None
        # Pooling runner (vLLM's pooling_params): an embedding request. It is scheduled like a
        # prompt-only request and finishes (blocks freed) when the step that completes its prompt
        # returns its pooler output; it never samples.
        self.pooling_params = pooling_params
        # P/D disaggregation (vLLM's kv_transfer_params; services/engine/kv_connector.py): whether a
        # consumer already decided on loading, the producer's segment handle (None: undecided, "":
        # nothing saved), and whether an aborted producer request's segment goes once saved.
        self.kv_transfer_params = kv_transfer_params
        self.kv_load_decided = False
        self.kv_save_handle: str | None = None
        self.kv_discard_after_save = False

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether every prompt position must still be computed (no prefix-cache hits)."""
        return self.prompt_logprobs is not None and not self.prompt_logprobs_sent

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def timings(self) -> pb.RequestTimings:
        """Where the request's time went so far, its last token now (for its final output)."""
        now = time.monotonic()
        scheduled = self.scheduled_time if self.scheduled_time is not None else now
        first_token = self.first_token_time if self.first_token_time is not None else now
        return pb.RequestTimings(queued_s=scheduled - self.arrival_time, prefill_s=first_token - scheduled,
                                 decode_s=now - first_token, inference_s=now - scheduled,
                                 num_preemptions=self.num_preemptions)

    def sort_key(self) -> tuple[int, float]:
        """Priority order: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time)
