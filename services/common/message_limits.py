"""How large a legal message between the services can be, and so each gRPC receive limit.

gRPC refuses a message above the receiver's max_receive_message_length before parsing it
(RESOURCE_EXHAUSTED): that limit is what bounds the memory one message can take. It must
also fit the largest *legal* message, or a valid request or step fails. So each bound here
is computed from the limits validation enforces (the constants below, MAX_LOGPROBS, the
structured-outputs limits, the VllmConfig), over protobuf's wire encoding: an int costs at
most 10 bytes as a varint (5 for a non-negative int32, which every legal token or block id
is), a float 4, a string its UTF-8 bytes (at most 4 per character) after a tag and a length.

The scheduler builds each step within STEP_BUDGET_BYTES (it stops adding requests to a step
past it), so the worker's limit is a constant it knows before any scheduler connects (a
tensor-parallel rank does not even know its model then).
"""

from __future__ import annotations

import functools

from services.common.config import MAX_NUM_SEQS_LIMIT
from services.common.proto import myvllm_pb2 as pb
from services.common.sampling_params import MAX_LOGPROBS
from services.common.structured_outputs import MAX_CHOICES, MAX_SPEC_CHARS

# What one request may carry (the scheduler refuses more: engine/request_limits.py).
MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_TOKENS = 128        # tokens in one bad-word sequence
MAX_LORA_NAME_CHARS = 256        # a LoRA adapter's served name
MAX_LORA_PATH_CHARS = 4096       # its directory (the longest path Linux resolves)
# A worker's error text is cut to this many characters before it is sent.
MAX_ERROR_CHARS = 4096
# The widest embedding the pooling runner sends (float32 values: a model's hidden size); a worker
# refuses to run a wider model as a pooling model.
MAX_POOLED_DIMENSIONS = 16384

# The bytes one SchedulerOutput may take: the scheduler adds no further request to a step past
# it. The first request of a step always goes (a configuration where one request's data could
# exceed the budget is refused at start-up), so a step is at most the budget or the finished
# ids plus one request. Far above a usual step: 256 decodes take ~20 KB, 256 prompts of 8K
# tokens re-sent after a worker restart ~11 MB.
STEP_BUDGET_BYTES = 32 << 20

_INT = 5           # a non-negative int32 varint
_ANY_INT = 10      # any int varint (a negative one takes 10)
_FIELD = 7         # a field's tag (up to 2 bytes) and length prefix (up to 5)


def _string_bytes(max_chars: int) -> int:
    return _FIELD + 4 * max_chars


@functools.cache
def sampling_params_bytes() -> int:
    """The largest legal SamplingParams (built, then measured)."""
    big = 2**31 - 1  # the widest non-negative int32: 5 bytes
    sp = pb.SamplingParams(
        temperature=1.0, top_p=1.0, top_k=-1, min_p=1.0, repetition_penalty=1.0, frequency_penalty=1.0,
        presence_penalty=1.0, seed=-1, max_tokens=-1, min_tokens=-1, ignore_eos=True,
        stop_token_ids=[big] * MAX_STOP_TOKEN_IDS, logprobs=MAX_LOGPROBS, prompt_logprobs=MAX_LOGPROBS,
        bad_words=[pb.TokenIds(ids=[big] * MAX_BAD_WORD_TOKENS)] * MAX_BAD_WORDS)
    for i in range(MAX_LOGIT_BIAS_ENTRIES):
        sp.logit_bias[big - i] = 100.0
    # The longest constraint: a schema, regex or grammar of MAX_SPEC_CHARS four-byte characters,
    # or choices whose JSON list takes MAX_SPEC_CHARS characters (each choice's bytes are at
    # most its JSON text) with a tag and length each.
    structured = _FIELD + max(_string_bytes(MAX_SPEC_CHARS), MAX_SPEC_CHARS + MAX_CHOICES * _FIELD)
    return sp.ByteSize() + structured


@functools.cache
def token_logprobs_bytes() -> int:
    """The largest TokenLogprobs (a sampled or prompt token's logprob, rank and top-k)."""
    return pb.TokenLogprobs(logprob=-1.0, rank=-1, top_ids=[2**31 - 1] * MAX_LOGPROBS,
                            top_logprobs=[-1.0] * MAX_LOGPROBS).ByteSize()


def lora_request_bytes() -> int:
    """The largest LoRARequest (its name, positive id and path)."""
    return _FIELD + _string_bytes(MAX_LORA_NAME_CHARS) + _INT + _string_bytes(MAX_LORA_PATH_CHARS)


def generate_request_bytes(max_model_len: int) -> int:
    """The largest legal ClientMessage a scheduler receives: a GenerateRequest whose prompt and
    resumed tokens stay under max_model_len, with the largest sampling parameters, ids and adapter."""
    return (4 * _FIELD + _INT * max_model_len + sampling_params_bytes() + _string_bytes(MAX_REQUEST_ID_CHARS)
            + _string_bytes(MAX_CACHE_SALT_CHARS) + 2 * _ANY_INT + 2 * _FIELD + _INT  # (+ pooling params)
            + lora_request_bytes())


def new_request_bytes(request_id_chars: int, num_tokens: int, num_blocks: int, sampling_bytes: int,
                      lora_bytes: int = 0) -> int:
    """A NewRequestData in a SchedulerOutput: the request's tokens, blocks, sampling and adapter
    (`lora_bytes`: its LoRARequest's size, 0 for none)."""
    return (6 * _FIELD + 4 * request_id_chars + _INT * (num_tokens + num_blocks + 2) + sampling_bytes
            + _INT  # + its num_scheduled_tokens entry (and its pooling params: one int)
            + (lora_bytes + 2 * _FIELD + _INT if lora_bytes else 0))  # (+ its slot)


def cached_request_bytes(request_id_chars: int, num_ids: int) -> int:
    """A CachedRequestData: its id and `num_ids` new block, token and draft ids."""
    return 4 * _FIELD + 4 * request_id_chars + _INT * (num_ids + 2)


def kv_transfer_bytes(request_id_chars: int, num_blocks: int) -> int:
    """A KVLoad or KVSave in a step's KV connector metadata: ids, handle, and per block its id and
    its 32-byte hash."""
    return 6 * _FIELD + 4 * request_id_chars + 64 + num_blocks * (_INT + _FIELD + 32)


def bitmask_row_bytes(vocab_size: int) -> int:
    """One request's allowed-token row (ceil(vocab / 32) int32 words) and its request id."""
    return 4 * -(-vocab_size // 32) + _string_bytes(MAX_REQUEST_ID_CHARS)


def finished_ids_bytes(count: int) -> int:
    return count * _string_bytes(MAX_REQUEST_ID_CHARS)


# The worker's receive limit: a step's budget, which one request alone may fill, after the
# finished ids (at most twice the most sequences any configuration runs), and a margin.
WORKER_RECEIVE_BYTES = STEP_BUDGET_BYTES + finished_ids_bytes(2 * MAX_NUM_SEQS_LIMIT) + (1 << 20)


def runner_output_bytes(max_num_seqs: int, max_num_batched_tokens: int, num_speculative_tokens: int) -> int:
    """The largest ModelRunnerOutput of one step: for each sequence its id, sampled tokens (one
    plus accepted drafts), their logprobs and its next drafts; prompt logprobs for every token
    the step computed; an error text; a LoRA load failure (id and error text) per sequence."""
    tokens_per_seq = 1 + num_speculative_tokens
    per_seq = (2 * _string_bytes(MAX_REQUEST_ID_CHARS) + tokens_per_seq * (2 * _INT + token_logprobs_bytes() + _FIELD)
               + 2 * _FIELD + 2 * _INT)
    prompt_logprobs = max_num_batched_tokens * (token_logprobs_bytes() + _FIELD)
    # A pooling engine's step instead: the embedding of every request whose prompt it completed
    # (each has at least one token in the step). An engine runs one runner: the larger of the two.
    pooled = min(max_num_seqs, max_num_batched_tokens) * (
        _string_bytes(MAX_REQUEST_ID_CHARS) + 4 * MAX_POOLED_DIMENSIONS + 3 * _FIELD)
    lora_failures = max_num_seqs * (2 * _FIELD + _string_bytes(MAX_REQUEST_ID_CHARS) + _string_bytes(MAX_ERROR_CHARS))
    return (8 * _FIELD + max(max_num_seqs * per_seq + prompt_logprobs, pooled) + _string_bytes(MAX_ERROR_CHARS)
            + 2 * _ANY_INT + lora_failures)


def receive_limit(legal_bytes: int) -> int:
    """A receive limit for messages of at most `legal_bytes`: a margin above it, so that a
    message a little over a field's limit is still read and refused with that field named;
    within gRPC's int32 range."""
    return min(legal_bytes + max(legal_bytes, 1 << 20), 2**31 - 1)
