"""The step being decided (its token budget, its message's size, what it runs) and how many
bytes a request adds to a step's message: each step stays within STEP_BUDGET_BYTES, what the
worker reads, so a step with many new requests of long prompts or big sampling parameters (as
after a worker restart) is spread over several."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common import message_limits
from services.common.message_limits import STEP_BUDGET_BYTES
from services.common.proto import myvllm_pb2 as pb
from services.engine.request import Request
from services.engine.spec_decode import WORKER_DRAFT


@dataclass
class StepPlan:
    token_budget: int
    step_bytes: int
    new: list[tuple[Request, int]] = field(default_factory=list)
    cached: list[tuple[Request, int, list[int]]] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    preempted: bool = False

    def fits(self, num_bytes: int) -> bool:
        """The first request of a step always goes (one request's data always fits a step)."""
        return not (self.new or self.cached) or self.step_bytes + num_bytes <= STEP_BUDGET_BYTES

    def add(self, request: Request, num_new: int, num_bytes: int, new_block_ids: list[int] | None = None) -> None:
        """Run `num_new` tokens of `request` in this step: a new request for the worker, or (with
        `new_block_ids`) one it holds."""
        self.ids.add(request.request_id)
        if new_block_ids is None:
            self.new.append((request, num_new))
        else:
            self.cached.append((request, num_new, new_block_ids))
        self.token_budget -= num_new
        self.step_bytes += num_bytes

    def unschedule(self, victim: Request) -> None:
        """Take back a request scheduled earlier in this step, and its tokens."""
        self.ids.discard(victim.request_id)
        for lst in (self.new, self.cached):
            for i, entry in enumerate(lst):
                if entry[0] is victim:
                    del lst[i]
                    self.token_budget += entry[1]
                    return

    @property
    def scheduled(self) -> list[tuple[Request, int]]:
        return self.new + [(r, n) for r, n, _ in self.cached]


class StepSizer:
    """How many bytes a request adds to a step's message, at most."""

    def __init__(self, block_size: int, lookahead_slots: int, row_bytes: int, pipeline_parallel: bool,
                 max_lora_bytes: int = 0) -> None:
        """`row_bytes`: a constrained request's bitmask row; `pipeline_parallel`: cached requests
        carry the tokens each step computes; `max_lora_bytes`: the largest LoRARequest a request may
        carry (0: LoRA off)."""
        self.max_lora_bytes = max_lora_bytes
        self.block_size = block_size
        self.lookahead_slots = lookahead_slots
        self.row_bytes = row_bytes
        self.pipeline_parallel = pipeline_parallel

    def max_blocks(self, num_tokens: int) -> int:
        """The most KV blocks a request of `num_tokens` tokens holds (with its lookahead slots)."""
        return (num_tokens + self.lookahead_slots) // self.block_size + 2

    def check(self, max_model_len: int, num_drafts: int) -> None:
        """One request's data must fit a step (the first request of a step always goes)."""
        largest = message_limits.new_request_bytes(
            message_limits.MAX_REQUEST_ID_CHARS, max_model_len, self.max_blocks(max_model_len),
            message_limits.sampling_params_bytes(), self.max_lora_bytes) + (1 + num_drafts) * self.row_bytes
        if largest > STEP_BUDGET_BYTES:
            raise ValueError(f"max_model_len {max_model_len}: one request's data in a step could take {largest} "
                             f"bytes, above the {STEP_BUDGET_BYTES} a step may carry (lower --max-model-len)")

    def request_bytes(self, request: Request, num_new: int, known: bool) -> int:
        """What scheduling `request` for `num_new` tokens adds: its full data if the worker does not
        hold it, else its new block, token and draft ids; a bitmask row per sampled position if it
        is constrained; its save if it is a producer's."""
        if known:
            num_ids = self.max_blocks(num_new) + len(request.spec_token_ids)
            if self.pipeline_parallel:
                num_ids += num_new  # the tokens the step computes
            num_bytes = message_limits.cached_request_bytes(len(request.request_id), num_ids)
        else:
            lora_bytes = request.lora_request.ByteSize() if request.lora_request is not None else 0
            num_bytes = message_limits.new_request_bytes(len(request.request_id), request.num_tokens,
                                                         self.max_blocks(request.num_tokens), request.sampling_bytes,
                                                         lora_bytes)
        if request.grammar is not None:
            num_bytes += self.row_bytes * (1 + len(request.spec_token_ids))
        if request.kv_transfer_params is not None and request.kv_transfer_params.do_remote_decode:
            num_bytes += message_limits.kv_transfer_bytes(len(request.request_id),
                                                          request.num_prompt_tokens // self.block_size)
        return num_bytes


def new_request_data(request: Request, block_ids: list[int]) -> pb.NewRequestData:
    """A request the worker does not hold yet: all of it."""
    return pb.NewRequestData(
        request_id=request.request_id, prompt_token_ids=request.prompt_token_ids, sampling=request.sampling,
        block_ids=block_ids, num_computed_tokens=request.num_computed_tokens,
        output_token_ids=request.output_token_ids, pooling=request.pooling_params,
        lora_request=request.lora_request, lora_slot=request.lora_slot or 0)


def cached_request_data(request: Request, num_new: int, new_block_ids: list[int],
                        pipeline_parallel: bool) -> pb.CachedRequestData:
    """A request the worker holds: what changed (new blocks, drafts; with pipeline parallelism,
    the tokens the step computes, which the first stage never sampled)."""
    start = request.num_computed_tokens
    # Drafts that fit this step's share (a budget cut may leave only some, or none).
    num_spec = max(start + num_new - request.num_tokens - request.num_output_placeholders, 0)
    if num_spec < len(request.spec_token_ids):
        del request.spec_token_ids[num_spec:]
    from_worker = bool(request.spec_token_ids) and request.spec_token_ids[0] == WORKER_DRAFT
    return pb.CachedRequestData(
        request_id=request.request_id, new_block_ids=new_block_ids, num_computed_tokens=start,
        new_token_ids=request.all_token_ids[start:start + num_new] if pipeline_parallel else (),
        spec_token_ids=() if from_worker else request.spec_token_ids,
        num_worker_drafts=len(request.spec_token_ids) if from_worker else 0,
        drafts_in_flight=request.num_drafts_in_flight > 0)
