"""What the scheduler accepts from a raw gRPC client, checked before a request is queued.

The gateway validates too, but the scheduler's port is a public contract (SDK clients,
other services): nothing a client sends may make the scheduler allocate without limit or
make a worker step fail for everyone in the batch (an out-of-vocabulary logit_bias key
would index past the logits). Each violation raises `InvalidRequest` with a message that
names the field; the server answers it with error_kind=INVALID_REQUEST.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from services.common.message_limits import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_CACHE_SALT_CHARS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_TOKEN_IDS,
)
from services.common.proto import myvllm_pb2 as pb
from services.common.sampling_params import MAX_LOGPROBS

MAX_PENALTY = 2.0                # frequency / presence penalties, as OpenAI and vLLM bound them
MAX_ABS_LOGIT_BIAS = 100.0


class InvalidRequest(ValueError):
    """The client's request cannot run as sent (its own mistake: HTTP 400 at a gateway)."""


def _check_token_ids(field: str, ids: Iterable[int], vocab_size: int) -> None:
    for t in ids:
        if not 0 <= t < vocab_size:
            raise InvalidRequest(f"{field}: token id {t} is out of range [0, {vocab_size})")


def _check_count(field: str, count: int, limit: int) -> None:
    if count > limit:
        raise InvalidRequest(f"{field}: {count} entries, at most {limit} allowed")


def _check_sampling(sp: pb.SamplingParams, vocab_size: int) -> None:
    floats = {"temperature": sp.temperature, "top_p": sp.top_p, "min_p": sp.min_p,
              "repetition_penalty": sp.repetition_penalty, "frequency_penalty": sp.frequency_penalty,
              "presence_penalty": sp.presence_penalty}
    for name, value in floats.items():
        if not math.isfinite(value):
            raise InvalidRequest(f"{name} must be a finite number, got {value}")
    # 0 means "off" for top_p and repetition_penalty in the proto (an unset field).
    if sp.temperature < 0:
        raise InvalidRequest(f"temperature must be non-negative, got {sp.temperature}")
    if not 0 <= sp.top_p <= 1:
        raise InvalidRequest(f"top_p must be in [0, 1] (0 = off), got {sp.top_p}")
    if not 0 <= sp.min_p <= 1:
        raise InvalidRequest(f"min_p must be in [0, 1], got {sp.min_p}")
    if sp.top_k < -1:
        raise InvalidRequest(f"top_k must be -1 or 0 (off) or positive, got {sp.top_k}")
    if sp.repetition_penalty < 0:
        raise InvalidRequest(f"repetition_penalty must be positive (0 = off), got {sp.repetition_penalty}")
    for name in ("frequency_penalty", "presence_penalty"):
        if abs(floats[name]) > MAX_PENALTY:
            raise InvalidRequest(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {floats[name]}")
    if sp.max_tokens < 0:
        raise InvalidRequest(f"max_tokens must be non-negative (0 = the rest of the context), got {sp.max_tokens}")
    if sp.min_tokens < 0:
        raise InvalidRequest(f"min_tokens must be non-negative, got {sp.min_tokens}")
    if sp.max_tokens and sp.min_tokens > sp.max_tokens:
        raise InvalidRequest(f"min_tokens ({sp.min_tokens}) must not exceed max_tokens ({sp.max_tokens})")
    if not -1 <= sp.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"logprobs must be in [0, {MAX_LOGPROBS}] (-1 = none), got {sp.logprobs}")
    if sp.HasField("prompt_logprobs") and not 0 <= sp.prompt_logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {sp.prompt_logprobs}")
    _check_count("stop_token_ids", len(sp.stop_token_ids), MAX_STOP_TOKEN_IDS)
    _check_token_ids("stop_token_ids", sp.stop_token_ids, vocab_size)
    _check_count("logit_bias", len(sp.logit_bias), MAX_LOGIT_BIAS_ENTRIES)
    _check_token_ids("logit_bias", sp.logit_bias.keys(), vocab_size)
    for token, bias in sp.logit_bias.items():
        if not (math.isfinite(bias) and abs(bias) <= MAX_ABS_LOGIT_BIAS):
            raise InvalidRequest(f"logit_bias for token {token} must be in [-100, 100], got {bias}")
    _check_count("bad_words", len(sp.bad_words), MAX_BAD_WORDS)
    for words in sp.bad_words:
        if not 1 <= len(words.ids) <= MAX_BAD_WORD_TOKENS:
            raise InvalidRequest(f"bad_words: each entry needs 1 to {MAX_BAD_WORD_TOKENS} token ids, "
                                 f"got {len(words.ids)}")
        _check_token_ids("bad_words", words.ids, vocab_size)


def validate_generate_request(req: pb.GenerateRequest, vocab_size: int, max_model_len: int) -> None:
    """Raise `InvalidRequest` naming the first thing wrong with `req`."""
    if not req.request_id:
        raise InvalidRequest("request_id must not be empty")
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id has {len(req.request_id)} characters, at most {MAX_REQUEST_ID_CHARS}")
    if len(req.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(f"cache_salt has {len(req.cache_salt)} characters, at most {MAX_CACHE_SALT_CHARS}")
    if not req.prompt_token_ids:
        raise InvalidRequest("prompt must contain at least one token")
    if len(req.prompt_token_ids) >= max_model_len:
        raise InvalidRequest(f"prompt has {len(req.prompt_token_ids)} tokens; max_model_len is {max_model_len} "
                             "(the prompt must leave room for at least one generated token)")
    # Only the size of a migrated request's resumed tokens is checked here (EngineCore checks
    # their values and that something is left to generate).
    num_resumed = len(req.resumed_output_token_ids)
    if num_resumed and len(req.prompt_token_ids) + num_resumed >= max_model_len:
        raise InvalidRequest(f"prompt ({len(req.prompt_token_ids)} tokens) and resumed output ({num_resumed}) fill "
                             f"max_model_len {max_model_len}: nothing left to generate")
    _check_token_ids("prompt", req.prompt_token_ids, vocab_size)
    _check_sampling(req.sampling, vocab_size)
