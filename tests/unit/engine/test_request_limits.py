"""The scheduler's checks of what a raw gRPC client sends (services/engine/request_limits.py)."""

from __future__ import annotations

import pytest

from services.common.param_errors import SamplingParamsError
from services.common.proto import myvllm_pb2 as pb
from services.common.sampling_params import SamplingParams
from services.engine import request_limits as limits
from services.engine.request_limits import InvalidRequest, validate_generate_request

VOCAB, MAX_LEN = 1000, 64


def _request(**sampling) -> pb.GenerateRequest:
    prompt = sampling.pop("prompt", [1, 2, 3])
    extra = {k: sampling.pop(k) for k in ("request_id", "cache_salt", "resumed_output_token_ids") if k in sampling}
    return pb.GenerateRequest(request_id=extra.get("request_id", "r1"), prompt_token_ids=prompt,
                              cache_salt=extra.get("cache_salt", ""),
                              resumed_output_token_ids=extra.get("resumed_output_token_ids", []),
                              sampling=pb.SamplingParams(**{"logprobs": -1, **sampling}))


def test_a_plain_request_and_the_proto_defaults_pass() -> None:
    validate_generate_request(_request(), VOCAB, MAX_LEN)
    validate_generate_request(_request(temperature=0.7, top_p=0.9, top_k=50, max_tokens=10, logprobs=20,
                                       prompt_logprobs=20, logit_bias={5: -100.0}), VOCAB, MAX_LEN)
    # A raw client's empty SamplingParams: top_p, repetition_penalty and max_tokens absent take
    # vLLM's defaults (1, 1, the rest of the context); top_k 0 is off, as in vLLM.
    validate_generate_request(pb.GenerateRequest(request_id="z", prompt_token_ids=[1]), VOCAB, MAX_LEN)
    validate_generate_request(_request(top_k=0), VOCAB, MAX_LEN)


@pytest.mark.parametrize(("fields", "message"), [
    ({"prompt": []}, "at least one token"),
    ({"prompt": list(range(MAX_LEN))}, "prompt has 64 tokens; max_model_len is 64"),
    ({"prompt": [1] * 40, "resumed_output_token_ids": [2] * 30}, "resumed output (30) fill max_model_len 64"),
    ({"prompt": [1, VOCAB]}, "prompt: token id 1000 is out of range"),
    ({"prompt": [-1]}, "prompt: token id -1 is out of range"),
    ({"request_id": ""}, "request_id must not be empty"),
    ({"request_id": "x" * 257}, "request_id has 257 characters"),
    ({"cache_salt": "s" * 1025}, "cache_salt has 1025 characters"),
    ({"max_tokens": -1}, "max_tokens must be at least 1, got -1"),
    ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
    ({"min_tokens": -2}, "min_tokens must be non-negative"),
    ({"max_tokens": 3, "min_tokens": 4}, "min_tokens (4) must not exceed max_tokens (3)"),
    ({"logprobs": 21}, "logprobs must be in [0, 20]"),
    ({"logprobs": -2}, "logprobs must be in [0, 20]"),
    ({"prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20]"),
    ({"temperature": -0.5}, "temperature must be non-negative"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ({"min_p": -0.1}, "min_p must be in [0, 1]"),
    ({"top_k": -3}, "top_k must be 0 (disable), or at least 1, got -3"),
    ({"repetition_penalty": -1.0}, "repetition_penalty must be positive"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be positive, got 0.0"),
    ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2]"),
    ({"presence_penalty": float("inf")}, "presence_penalty must be a finite number"),
    ({"stop_token_ids": [1] * 1025}, "stop_token_ids: 1025 entries, at most 1024"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids: token id 1000 is out of range"),
    ({"logit_bias": {i: 1.0 for i in range(1025)}}, "logit_bias: 1025 entries, at most 1024"),
    ({"logit_bias": {VOCAB: 1.0}}, "logit_bias: token id 1000 is out of range"),
    ({"logit_bias": {3: 101.0}}, "logit_bias values must be in [-100, 100], got 101.0"),
    ({"bad_words": [pb.TokenIds(ids=[1])] * 1025}, "bad_words: 1025 entries, at most 1024"),
    ({"bad_words": [pb.TokenIds(ids=[])]}, "each entry needs 1 to 128 token ids, got 0"),
    ({"bad_words": [pb.TokenIds(ids=[1] * 129)]}, "got 129"),
    ({"bad_words": [pb.TokenIds(ids=[VOCAB])]}, "bad_words: token id 1000 is out of range"),
])
def test_each_violation_is_refused_with_a_message_naming_it(fields: dict, message: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        validate_generate_request(_request(**fields), VOCAB, MAX_LEN)
    assert message in str(info.value)


def test_limits_are_at_the_documented_values() -> None:
    # docs/deployment.md's "Faults and limits" section quotes these.
    assert (limits.MAX_STOP_TOKEN_IDS, limits.MAX_LOGIT_BIAS_ENTRIES, limits.MAX_BAD_WORDS) == (1024, 1024, 1024)
    assert issubclass(InvalidRequest, ValueError)  # EngineCore callers catch ValueError


@pytest.mark.parametrize("values", [
    {"top_p": 0.0}, {"top_p": 2**-30}, {"top_p": 1.0}, {"top_p": 1.01}, {"top_k": 0}, {"top_k": -1}, {"top_k": -2},
    {"top_k": 1}, {"max_tokens": 0}, {"max_tokens": 1}, {"repetition_penalty": 0.0}, {"repetition_penalty": 2**-10},
    {"temperature": 0.0}, {"temperature": -(2**-30)}, {"min_p": 1.0}, {"min_p": 1.5}, {"frequency_penalty": -2.0},
    {"presence_penalty": 2.01}, {"logprobs": 0}, {"logprobs": 20}, {"logprobs": 21}, {"prompt_logprobs": 0},
    {"min_tokens": 5, "max_tokens": 4}, {"logit_bias": {7: 100.0}}, {"logit_bias": {7: -100.5}},
])
def test_the_scheduler_and_the_python_api_accept_and_refuse_the_same_values(values: dict) -> None:
    """One rule set: what `SamplingParams(...)` (the offline LLM, the gateway) refuses, a raw
    gRPC client's proto with the same values is refused for, and the reverse."""
    try:
        SamplingParams(**values)
        python_ok = True
    except SamplingParamsError:
        python_ok = False
    try:
        validate_generate_request(_request(**values), VOCAB, MAX_LEN)
        proto_ok = True
    except InvalidRequest:
        proto_ok = False
    assert proto_ok == python_ok
    if python_ok:  # and what passes means the same on the wire (values exact in float32)
        assert SamplingParams.from_proto(SamplingParams(**values).to_proto()) == SamplingParams(**values)


def test_an_absent_max_tokens_gets_the_rest_of_the_context_from_the_engine() -> None:
    """vLLM's default, applied in one place (the gateway and the SDK leave the field unset)."""
    from services.common.config import VllmConfig
    from services.engine.engine_core import EngineCore

    core = EngineCore(VllmConfig.from_engine_args(model="unused"), pb.ModelInfo(max_model_len=MAX_LEN, vocab_size=VOCAB,
                                                                  eos_token_ids=[2], device="cpu"), num_blocks=32)
    core.add_request(pb.GenerateRequest(request_id="free", prompt_token_ids=[5] * 10, sampling=pb.SamplingParams()))
    core.add_request(_request(request_id="five", max_tokens=5))
    assert core.scheduler.requests["free"].max_tokens == MAX_LEN - 10
    assert core.scheduler.requests["five"].max_tokens == 5
    core.structured_output.close()
