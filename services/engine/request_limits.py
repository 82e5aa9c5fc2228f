"""What the scheduler accepts from a raw gRPC client, checked before a request is queued.

The gateway validates too, but the scheduler's port is a public contract (SDK clients,
other services): nothing a client sends may make the scheduler allocate without limit or
make a worker step fail for everyone in the batch (an out-of-vocabulary logit_bias key
would index past the logits). Each violation raises `InvalidRequest` with a message that
names the field; the server answers it with error_kind=INVALID_REQUEST.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.common.message_limits import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_CACHE_SALT_CHARS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_TOKEN_IDS,
)
from services.common.param_errors import SamplingParamsError
from services.common.proto import myvllm_pb2 as pb
from services.common.sampling_params import SamplingParams
from services.engine.request import Request


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
    # Sizes first (each later check walks the lists), then the value rules every entry point
    # shares, then ids against the model's vocabulary (only the engine knows it).
    _check_count("stop_token_ids", len(sp.stop_token_ids), MAX_STOP_TOKEN_IDS)
    _check_count("logit_bias", len(sp.logit_bias), MAX_LOGIT_BIAS_ENTRIES)
    _check_count("bad_words", len(sp.bad_words), MAX_BAD_WORDS)
    try:
        SamplingParams.from_proto(sp)
    except SamplingParamsError as e:
        raise InvalidRequest(str(e)) from None
    _check_token_ids("stop_token_ids", sp.stop_token_ids, vocab_size)
    _check_token_ids("logit_bias", sp.logit_bias.keys(), vocab_size)
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
    if req.HasField("pooling"):  # an embedding request generates nothing: the prompt may fill the context
        if len(req.prompt_token_ids) > max_model_len:
            raise InvalidRequest(f"prompt has {len(req.prompt_token_ids)} tokens; max_model_len is {max_model_len}")
        if req.resumed_output_token_ids:
            raise InvalidRequest("a pooling request has no output tokens to resume")
        _check_token_ids("prompt", req.prompt_token_ids, vocab_size)
        return
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


def check_request_fits(request: Request, max_model_len: int, capacity: int, lookahead_slots: int) -> None:
    """The prompt fits the context, and the request could finish with the whole KV pool
    (`capacity` tokens) to itself: otherwise it would preempt itself forever. ValueError with the
    numbers."""
    # (An embedding request generates nothing: its prompt may fill the context.)
    if request.num_tokens > max_model_len or (request.num_tokens == max_model_len and not request.is_pooling):
        raise ValueError(f"prompt has {request.num_tokens} tokens; max_model_len is {max_model_len}")
    # (max_tokens counts a migrated request's resumed outputs too: they are not extra.)
    # (A draft model's lookahead slots count: the scheduler allocates them with every step.)
    needed = min(request.num_prompt_tokens + request.max_tokens + lookahead_slots, max_model_len)
    if needed > capacity:
        raise ValueError(
            f"request needs KV cache for up to {needed} tokens ({request.num_prompt_tokens} prompt + "
            f"{request.max_tokens} max_tokens) but the cache holds only {capacity}")
