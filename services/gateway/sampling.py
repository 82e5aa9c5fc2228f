"""OpenAI request fields -> validated `SamplingParams` (and the context-length check)."""

from __future__ import annotations

from collections.abc import Mapping

from services.common.message_limits import MAX_LOGIT_BIAS_ENTRIES
from services.common.proto import myvllm_pb2 as pb
from services.common.sampling_params import MAX_ABS_LOGIT_BIAS, SamplingParams
from services.common.structured_outputs import StructuredOutputsParams
from services.gateway.errors import invalid_request
from services.gateway.protocol import GenerationRequest
from services.gateway.request_defaults import RequestDefaults
from services.text.tokenizer import Tokenizer

# OpenAI's limit on choices per request: each one is an engine request.
MAX_N = 128

# OpenAI fields whose `null` means "the default"; SamplingParams wants a value.
_NULLABLE_DEFAULTS = {
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
    "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
}


def check_context_length(requested: int | None, num_prompt_tokens: int, max_model_len: int,
                         prompt_name: str) -> None:
    """A 400 `context_length_exceeded` naming both numbers when prompt plus completion do not
    fit (`prompt_name` is "messages" or "prompt"). An unset `requested` stays unset: the engine
    gives it the rest of the context (vLLM's default, computed there alone)."""
    intro = f"This model's maximum context length is {max_model_len} tokens. However, "
    if requested is None:
        if num_prompt_tokens >= max_model_len:
            raise invalid_request(
                f"{intro}your request has {num_prompt_tokens} input tokens, which leaves no room for a "
                f"completion. Please reduce the length of the {prompt_name}.",
                param=prompt_name, code="context_length_exceeded")
    elif num_prompt_tokens + requested > max_model_len:
        raise invalid_request(
            f"{intro}you requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
            f"{prompt_name}, {requested} in the completion). Please reduce the length of the {prompt_name} "
            f"or completion.", param=prompt_name, code="context_length_exceeded")


def check_prompt_logprobs_not_streamed(request: GenerationRequest) -> None:
    """vLLM's rule: prompt_logprobs come whole in the response, so not with stream=true."""
    if request.stream and request.prompt_logprobs is not None:
        raise invalid_request("prompt_logprobs is not available when stream is true", param="prompt_logprobs")


def build_sampling_params(request: GenerationRequest, tokenizer: Tokenizer, max_tokens: int | None,
                          logprobs: int | None, prompt_logprobs: int | None = None,
                          structured_outputs: StructuredOutputsParams | None = None,
                          skip_special_tokens: bool | None = None,
                          defaults: RequestDefaults | None = None) -> tuple[SamplingParams, pb.SamplingParams]:
    """Validated params (SamplingParamsError names a bad field) and their engine proto;
    `prompt_logprobs` defaults to the request's own (vLLM's extension field), as does
    `skip_special_tokens` (a tool-call parser may need the special tokens kept). `defaults`: the
    server's (--generation-config's values where the request leaves a field unset, --max-logprobs)."""
    if not 1 <= request.n <= MAX_N:
        raise invalid_request(f"n must be between 1 and {MAX_N}, got {request.n}", param="n")
    defaults = defaults or RequestDefaults()
    prompt_logprobs = request.prompt_logprobs if prompt_logprobs is None else prompt_logprobs
    logprobs_param = "top_logprobs" if hasattr(request, "top_logprobs") else "logprobs"  # (chat's, completions')
    defaults.check_logprobs(logprobs, prompt_logprobs, logprobs_param)
    values = {name: defaults.value(name, getattr(request, name), default)
              for name, default in _NULLABLE_DEFAULTS.items()}
    if request.allowed_token_ids is not None:
        check_allowed_token_ids(request.allowed_token_ids, tokenizer.vocab_size)
    # The generation config's max_new_tokens where the request gives none (checked against the
    # context as none: the engine stops at max_model_len, so it never asks for more than is left).
    max_tokens = defaults.value("max_tokens", max_tokens)
    params = SamplingParams(
        n=request.n,
        seed=request.seed,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        stop=request.stop,
        stop_token_ids=request.stop_token_ids,
        include_stop_str_in_output=request.include_stop_str_in_output,
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=request.logit_bias,
        bad_words=request.bad_words,
        skip_special_tokens=request.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
        structured_outputs=structured_outputs,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        # vLLM passes vllm_xargs to the engine here; no extension of this engine reads them.
        extra_args=dict(request.vllm_xargs) if request.vllm_xargs else None,
        **values,
    )
    params.bad_words_token_ids = tokenizer.bad_words_token_ids(params.bad_words)
    if request.allowed_token_ids is not None:
        params.logit_bias = restrict_to_allowed(params.logit_bias, request.allowed_token_ids)
    return params, params.to_proto(tokenizer.vocab_size)


def check_allowed_token_ids(allowed: list[int], vocab_size: int) -> None:
    """vLLM's rules for allowed_token_ids (non-empty, in the vocabulary), plus this engine's
    bound on logit_bias entries, which carry them."""
    if not allowed:
        raise invalid_request("allowed_token_ids must not be empty", param="allowed_token_ids")
    if len(set(allowed)) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid_request(f"allowed_token_ids has {len(set(allowed))} distinct ids, at most "
                              f"{MAX_LOGIT_BIAS_ENTRIES}", param="allowed_token_ids")
    for token_id in allowed:
        if not 0 <= token_id < vocab_size:
            raise invalid_request(f"allowed_token_ids has token id {token_id}, out of the vocabulary "
                                  f"(size {vocab_size})", param="allowed_token_ids")


def restrict_to_allowed(logit_bias: Mapping[int | str, float], allowed: list[int]) -> dict[int, float]:
    """The logit bias that restricts sampling to `allowed` (vLLM's allowed_token_ids).

    The engine has no token mask a request can set, but it adds logit_bias: every allowed token
    is raised by the same amount, so that the largest bias is the most the engine takes
    (MAX_ABS_LOGIT_BIAS). Among the allowed tokens their own biases keep their differences (a
    shift common to all changes no probability among them); any other token falls that far
    behind, which leaves it a probability too small to be sampled at any usual temperature, and
    its own bias is dropped (vLLM masks it whatever its bias)."""
    own: dict[int, float] = {}
    for key, value in logit_bias.items():
        try:
            own[int(key)] = float(value)
        except (TypeError, ValueError):
            raise invalid_request(f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
    allowed_ids = set(allowed)
    shift = MAX_ABS_LOGIT_BIAS - max(own.get(t, 0.0) for t in allowed_ids)
    return {t: own.get(t, 0.0) + shift for t in sorted(allowed_ids)}
