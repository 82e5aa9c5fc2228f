"""The worker's check of a step before any kernel sees it (a trust boundary: docs/design.md).

Block ids, slots and lengths of a `SchedulerOutput` become raw offsets in the C kernels (the
decode step writes K/V at `slot * bytes_per_slot`, the attention kernels read `block_table[i]`
unchecked): a wrong value there is an out-of-bounds write, not an error. So every index a step
carries is checked against what this worker holds before the batch is touched: block ids within
the KV cache, token ids within the vocabulary, lengths within the request's blocks and
max_model_len, the batch within max_num_seqs, request ids known (or new). A step that fails
raises `InvalidStep` naming the field; nothing was applied, and the worker serves on.

Per step the cost is one pass over the scheduled requests (no per-token Python loop): token
lists are checked with numpy's min/max.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.common.pooling_config import dimensions_error
from services.common.proto import myvllm_pb2 as pb
from services.worker.input_batch import InputBatch, runs_own_counts


class InvalidStep(ValueError):
    """A step the worker refuses; `field` names the offending part of the SchedulerOutput."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"invalid SchedulerOutput: {field}: {message}")
        self.field = field


def _check_ids(field: str, ids, limit: int) -> None:
    """Every id in [0, limit)."""
    if len(ids):
        arr = np.asarray(ids, dtype=np.int64)
        low, high = int(arr.min()), int(arr.max())
        if low < 0 or high >= limit:
            raise InvalidStep(field, f"id {low if low < 0 else high} outside [0, {limit})")


def _check_sampling(field: str, sampling: pb.SamplingParams, vocab_size: int) -> None:
    _check_ids(f"{field}.stop_token_ids", sampling.stop_token_ids, vocab_size)
    _check_ids(f"{field}.logit_bias", list(sampling.logit_bias), vocab_size)
    for i, words in enumerate(sampling.bad_words):
        _check_ids(f"{field}.bad_words[{i}]", words.ids, vocab_size)
    if sampling.logprobs > vocab_size:
        raise InvalidStep(f"{field}.logprobs", f"{sampling.logprobs} > vocab size {vocab_size}")
    if sampling.HasField("prompt_logprobs") and not 0 <= sampling.prompt_logprobs <= vocab_size:
        raise InvalidStep(f"{field}.prompt_logprobs", f"{sampling.prompt_logprobs} outside [0, {vocab_size}]")


@dataclass(frozen=True)
class PoolingLimits:
    """What a pooling worker accepts of a pooling request (None where the worker runs the
    generate runner: no request may pool)."""

    hidden_size: int
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()


def _check_pooling(field: str, r: pb.NewRequestData, pooling: PoolingLimits | None) -> None:
    """A pooling request only on a pooling worker (and every request there pools), starting from
    nothing computed (its MEAN sum starts empty: there is no prefix cache under pooling) with no
    outputs, and asking only for dimensions the model allows."""
    if not r.HasField("pooling"):
        if pooling is not None:
            raise InvalidStep(f"{field}.pooling", "this worker runs the pooling runner: every request must pool")
        return
    if pooling is None:
        raise InvalidStep(f"{field}.pooling", "this worker runs the generate runner: no request may pool")
    if r.num_computed_tokens != 0 or r.output_token_ids:
        raise InvalidStep(f"{field}.num_computed_tokens", "a pooling request starts with nothing computed and no "
                                                          "output tokens")
    error = dimensions_error(r.pooling.dimensions, pooling.hidden_size, pooling.is_matryoshka,
                             pooling.matryoshka_dimensions)
    if error is not None:
        raise InvalidStep(f"{field}.pooling", error)


def _check_lora(field: str, r: pb.NewRequestData, max_loras: int) -> None:
    if max_loras == 0:
        raise InvalidStep(f"{field}.lora_request", "this worker serves no LoRA adapters (start it with --enable-lora)")
    if not 0 <= r.lora_slot < max_loras:
        raise InvalidStep(f"{field}.lora_slot", f"{r.lora_slot} outside the {max_loras} slots (--max-loras)")
    if r.lora_request.lora_int_id < 1:
        raise InvalidStep(f"{field}.lora_request.lora_int_id", f"{r.lora_request.lora_int_id} (must be >= 1)")
    if not r.lora_request.lora_path:
        raise InvalidStep(f"{field}.lora_request.lora_path", "empty")


def validate_step(so: pb.SchedulerOutput, batch: InputBatch, num_kv_blocks: int, vocab_size: int,
                  pooling: PoolingLimits | None = None, max_loras: int = 0) -> None:
    """Raise `InvalidStep` unless applying `so` to `batch` keeps every index in bounds (and, on a
    pooling worker (`pooling`), every pooling request is one it can pool; a request with a LoRA
    adapter names a slot of the `max_loras` this worker has, 0 = LoRA off)."""
    if so.grammar_bitmask_only:
        if so.new_requests or so.cached_requests or so.num_scheduled_tokens:
            raise InvalidStep("grammar_bitmask_only", "a bitmask-only message schedules nothing")
        _check_bitmask(so, vocab_size)
        return
    num_reqs = len(so.new_requests) + len(so.cached_requests)
    if len(so.num_scheduled_tokens) != num_reqs:
        raise InvalidStep("num_scheduled_tokens", f"{len(so.num_scheduled_tokens)} entries for {num_reqs} requests")
    scheduled = np.asarray(so.num_scheduled_tokens, dtype=np.int64)
    if num_reqs and int(scheduled.min()) < 1:
        raise InvalidStep("num_scheduled_tokens", f"{int(scheduled.min())} tokens for a request (need >= 1)")
    bs, max_len = batch.block_size, batch.max_model_len
    held = set(batch.req_id_to_row).difference(so.finished_request_ids)
    new_ids = [r.request_id for r in so.new_requests]
    if len(set(new_ids)) != len(new_ids):
        raise InvalidStep("new_requests.request_id", "a request id appears twice")
    after = held.union(new_ids)
    if len(after) > batch.max_num_reqs:
        raise InvalidStep("new_requests", f"{len(after)} requests in the batch > max_num_seqs {batch.max_num_reqs}")

    for i, r in enumerate(so.new_requests):
        field = f"new_requests[{i}]"
        n = len(r.prompt_token_ids) + len(r.output_token_ids)
        if not 1 <= n <= max_len:
            raise InvalidStep(f"{field}.prompt_token_ids", f"{n} tokens outside [1, max_model_len {max_len}]")
        _check_ids(f"{field}.prompt_token_ids", r.prompt_token_ids, vocab_size)
        _check_ids(f"{field}.output_token_ids", r.output_token_ids, vocab_size)
        _check_ids(f"{field}.block_ids", r.block_ids, num_kv_blocks)
        if len(r.block_ids) > batch.max_blocks_per_req:
            raise InvalidStep(f"{field}.block_ids",
                              f"{len(r.block_ids)} blocks > {batch.max_blocks_per_req} per request")
        end = r.num_computed_tokens + int(scheduled[i])
        if r.num_computed_tokens < 0 or end > n or end > len(r.block_ids) * bs:
            raise InvalidStep(f"{field}.num_computed_tokens",
                              f"tokens [{r.num_computed_tokens}, {end}) outside the request's {n} tokens "
                              f"or its {len(r.block_ids)} blocks of {bs}")
        _check_sampling(f"{field}.sampling", r.sampling, vocab_size)
        _check_pooling(field, r, pooling)
        if r.HasField("lora_request"):
            _check_lora(field, r, max_loras)

    seen: set[str] = set()
    offset = len(so.new_requests)
    rows, num_blocks_held, num_tokens = batch.req_id_to_row, batch.num_blocks, batch.num_tokens
    for i, r in enumerate(so.cached_requests):  # the per-step path: a few comparisons per request
        rid = r.request_id
        if rid not in held or rid in seen or rid in new_ids:
            raise InvalidStep(f"cached_requests[{i}].request_id",
                              f"{rid!r} is not a request this worker holds (or appears twice)")
        seen.add(rid)
        row = rows[rid]
        num_blocks = int(num_blocks_held[row]) + len(r.new_block_ids)
        if r.new_block_ids:
            _check_ids(f"cached_requests[{i}].new_block_ids", r.new_block_ids, num_kv_blocks)
            if num_blocks > batch.max_blocks_per_req:
                raise InvalidStep(f"cached_requests[{i}].new_block_ids",
                                  f"{num_blocks} blocks > {batch.max_blocks_per_req} per request")
        if runs_own_counts(r):
            _check_blind_row(i, r, int(scheduled[offset + i]), batch, row, num_blocks, max_len)
            continue
        known, num_spec, computed = int(num_tokens[row]), len(r.spec_token_ids), r.num_computed_tokens
        if r.new_token_ids:
            _check_ids(f"cached_requests[{i}].new_token_ids", r.new_token_ids, vocab_size)
            known = max(known, computed + len(r.new_token_ids))
        if num_spec:
            _check_ids(f"cached_requests[{i}].spec_token_ids", r.spec_token_ids, vocab_size)
        # The drafts are written after the known tokens: the row must hold them.
        if known + num_spec > max_len:
            raise InvalidStep(f"cached_requests[{i}].spec_token_ids",
                              f"{known} + {num_spec} tokens > max_model_len {max_len}")
        end = computed + int(scheduled[offset + i])
        if computed < 0 or end > known + num_spec or end > num_blocks * bs:
            raise InvalidStep(f"cached_requests[{i}].num_computed_tokens",
                              f"tokens [{computed}, {end}) beyond the request's {known + num_spec} tokens "
                              f"or its {num_blocks} blocks of {bs}")
    _check_bitmask(so, vocab_size)


def _check_blind_row(i: int, r: pb.CachedRequestData, scheduled: int, batch: InputBatch, row: int, num_blocks: int,
                     max_len: int) -> None:
    """A row scheduled without knowing its previous step's outcome (num_worker_drafts /
    drafts_in_flight): the worker runs its last token and up to num_worker_drafts of its own
    drafts; the scheduler's counts must bound that, and the row's blocks must hold it."""
    field = f"cached_requests[{i}]"
    if r.spec_token_ids or r.new_token_ids:
        raise InvalidStep(f"{field}.spec_token_ids", "a row scheduled with num_worker_drafts / drafts_in_flight "
                                                     "carries no token ids")
    if r.num_worker_drafts < 0 or scheduled != 1 + r.num_worker_drafts:
        raise InvalidStep(f"{field}.num_worker_drafts", f"{r.num_worker_drafts} worker drafts scheduled as "
                                                        f"{scheduled} tokens (must be 1 + num_worker_drafts)")
    start, num_spec = batch.own_counts(row, r.num_worker_drafts)
    end = start + 1 + num_spec
    if r.num_computed_tokens < start or end > max_len or end > num_blocks * batch.block_size:
        raise InvalidStep(f"{field}.num_computed_tokens",
                          f"the row runs tokens [{start}, {end}): below the scheduled {r.num_computed_tokens}, past "
                          f"max_model_len {max_len} or its {num_blocks} blocks of {batch.block_size}")


def _check_bitmask(so: pb.SchedulerOutput, vocab_size: int) -> None:
    """The rows of allowed tokens, when this message is the one that applies them."""
    ids = so.structured_output_request_ids
    if not ids or so.grammar_bitmask_follows:
        return
    words = -(-vocab_size // 32)
    if len(so.grammar_bitmask) != len(ids) * words * 4:
        raise InvalidStep("grammar_bitmask", f"{len(so.grammar_bitmask)} bytes for {len(ids)} rows of "
                                             f"{words} 32-bit words")
