"""vLLM-compatible `SamplingParams`: the user-facing knobs of one generation.

The rules for their values live here once, with vLLM's semantics, for the offline `LLM`, the
HTTP gateway and the scheduler (which reads a raw gRPC client's proto back into this class,
`from_proto`) alike: a bad value raises `SamplingParamsError` whose `param` names the field
(the gateway turns it into an OpenAI 400 with that `param`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from services.common.param_errors import SamplingParamsError
from services.common.proto import myvllm_pb2 as pb
from services.common.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_ABS_PENALTY = 2.0        # frequency / presence penalties, as OpenAI and vLLM bound them
MAX_ABS_LOGIT_BIAS = 100.0
# Below this temperature a request samples greedily (the argmax), as in vLLM; so does top_k 1
# (the worker's sampling metadata applies the rule).
GREEDY_TEMPERATURE = 1e-5
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def _check_type(name: str, value: Any, types: tuple[type, ...], allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    # bool is an int subclass; a JSON `true` is never a valid number here.
    if isinstance(value, bool) and bool not in types:
        raise SamplingParamsError(name, f"{name} must be of type {types[0].__name__}, got bool")
    if not isinstance(value, types):
        raise SamplingParamsError(
            name, f"{name} must be of type {types[0].__name__}, got {type(value).__name__}"
        )


@dataclass
class SamplingParams:
    """How to sample one request's completion (names and defaults as in vLLM)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Constrained decoding (JSON schema, regex, choice, grammar), vLLM's field.
    structured_outputs: StructuredOutputsParams | None = None
    # Token-id sequences for bad_words, filled from `bad_words` by whoever holds the tokenizer.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # vLLM's extra_args: settings for engine extensions. "kv_transfer_params" (P/D disaggregation,
    # services/common/kv_transfer_params.py) is the one this engine reads; the offline LLM sends it
    # with the request, never in the sampling settings.
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.logit_bias is None:
            self.logit_bias = {}
        if self.bad_words is None:
            self.bad_words = []
        self.validate()

    def validate(self) -> None:
        """Raise `SamplingParamsError` naming the first invalid field."""
        _check_type("n", self.n, (int,))
        if self.n < 1:
            raise SamplingParamsError("n", f"n must be at least 1, got {self.n}")
        for name in _FLOAT_FIELDS:
            _check_type(name, getattr(self, name), (float, int))
            if not math.isfinite(getattr(self, name)):
                raise SamplingParamsError(name, f"{name} must be a finite number, got {getattr(self, name)}")
        _check_type("top_k", self.top_k, (int,))
        _check_type("seed", self.seed, (int,), allow_none=True)
        _check_type("max_tokens", self.max_tokens, (int,), allow_none=True)
        _check_type("min_tokens", self.min_tokens, (int,))
        _check_type("logprobs", self.logprobs, (int,), allow_none=True)
        _check_type("prompt_logprobs", self.prompt_logprobs, (int,), allow_none=True)
        if self.temperature < 0:
            raise SamplingParamsError("temperature", f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:  # -1 and 0 both turn it off (vLLM prefers 0)
            raise SamplingParamsError("top_k", f"top_k must be 0 (disable), or at least 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise SamplingParamsError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise SamplingParamsError(
                "repetition_penalty", f"repetition_penalty must be positive, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -MAX_ABS_PENALTY <= getattr(self, name) <= MAX_ABS_PENALTY:
                raise SamplingParamsError(name, f"{name} must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}], "
                                                f"got {getattr(self, name)}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise SamplingParamsError("min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SamplingParamsError("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise SamplingParamsError(
                "prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise SamplingParamsError("stop", "stop must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise SamplingParamsError("stop", "stop strings must not be empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", "stop_token_ids must be a list of integers")
        if not isinstance(self.logit_bias, dict):
            raise SamplingParamsError("logit_bias", "logit_bias must map token ids to numbers")
        for k, v in self.logit_bias.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise SamplingParamsError("logit_bias", f"logit_bias value for {k!r} must be a number")
            if not (math.isfinite(v) and -MAX_ABS_LOGIT_BIAS <= v <= MAX_ABS_LOGIT_BIAS):
                raise SamplingParamsError("logit_bias", f"logit_bias values must be in [-{MAX_ABS_LOGIT_BIAS:g}, "
                                                        f"{MAX_ABS_LOGIT_BIAS:g}], got {v}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise SamplingParamsError("extra_args", "extra_args must be a dict")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise SamplingParamsError("structured_outputs",
                                          "structured_outputs must be a StructuredOutputsParams")

    @classmethod
    def from_proto(cls, sp: pb.SamplingParams) -> SamplingParams:
        """The engine-level settings a proto carries (what `to_proto` writes; its structured
        outputs are left out: the scheduler checks those when it compiles them), validated:
        raises SamplingParamsError naming the first bad field."""
        return cls(
            temperature=sp.temperature,
            top_p=sp.top_p if sp.HasField("top_p") else 1.0,
            top_k=sp.top_k,
            min_p=sp.min_p,
            repetition_penalty=sp.repetition_penalty if sp.HasField("repetition_penalty") else 1.0,
            frequency_penalty=sp.frequency_penalty,
            presence_penalty=sp.presence_penalty,
            seed=sp.seed if sp.HasField("seed") else None,
            max_tokens=sp.max_tokens if sp.HasField("max_tokens") else None,
            min_tokens=sp.min_tokens,
            stop_token_ids=list(sp.stop_token_ids),
            ignore_eos=sp.ignore_eos,
            logprobs=None if sp.logprobs == -1 else sp.logprobs,  # -1: none
            prompt_logprobs=sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None,
            logit_bias=dict(sp.logit_bias),
            bad_words_token_ids=[list(words.ids) for words in sp.bad_words],
        )

    def to_proto(self, vocab_size: int | None = None) -> pb.SamplingParams:
        """The engine-level part of these params, as sent to the scheduler."""
        bias = {}
        for k, v in self.logit_bias.items():
            try:
                token = int(k)
            except (TypeError, ValueError):
                raise SamplingParamsError("logit_bias", f"logit_bias key {k!r} is not a token id") from None
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise SamplingParamsError("logit_bias", f"logit_bias token id {token} is out of range")
            bias[token] = float(v)
        msg = pb.SamplingParams(
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=int(self.top_k),
            min_p=float(self.min_p),
            repetition_penalty=float(self.repetition_penalty),
            frequency_penalty=float(self.frequency_penalty),
            presence_penalty=float(self.presence_penalty),
            min_tokens=int(self.min_tokens),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=bool(self.ignore_eos),
            logit_bias=bias,
            bad_words=[pb.TokenIds(ids=ids) for ids in self.bad_words_token_ids],
            logprobs=-1 if self.logprobs is None else int(self.logprobs),
        )
        if self.seed is not None:
            msg.seed = int(self.seed)
        if self.max_tokens is not None:
            msg.max_tokens = int(self.max_tokens)
        if self.prompt_logprobs is not None:
            msg.prompt_logprobs = int(self.prompt_logprobs)
        if self.structured_outputs is not None:
            msg.structured_outputs.CopyFrom(self.structured_outputs.to_proto())
        return msg


def sampling_for_choice(sampling: pb.SamplingParams, index: int) -> pb.SamplingParams:
    """The engine settings of sample `index` of an `n > 1` request (vLLM's rule, shared by the
    offline `LLM` and the gateway): a seeded request's choices get seeds seed, seed+1, ...,
    so they differ from each other yet each reproduces."""
    if index == 0 or not sampling.HasField("seed"):
        return sampling
    choice = pb.SamplingParams()
    choice.CopyFrom(sampling)
    choice.seed = sampling.seed + index
    return choice
