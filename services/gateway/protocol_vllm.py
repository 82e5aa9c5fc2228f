"""vLLM's extensions to the OpenAI chat and completions request bodies, so that a body a vLLM
server answers is answered here too.

Each field has vLLM's meaning where this server has the feature (the serving modules read
them), is accepted and changes nothing where vLLM's own effect would be nil here (beam-search
knobs at their defaults, render-only flags, routing hints), and is refused by name where the
value asks for something this server lacks (`unsupported_field`).

Keys no model declares are ignored, as vLLM does: `LenientModel` keeps their names, and
request_fields.py logs them (or refuses them under --strict-request-fields).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

# A client's request_id is part of every engine request id, which the scheduler bounds
# (message_limits.MAX_REQUEST_ID_CHARS); this leaves room for the prefix and suffixes.
MAX_CLIENT_REQUEST_ID_CHARS = 200

# vLLM's older names for the structured_outputs kinds (its `guided_*` fields).
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
# The constrained-decoding backend here; vLLM's guided_decoding_backend may name it (or "auto").
STRUCTURED_OUTPUTS_BACKENDS = ("xgrammar", "auto")

# Fields whose any non-empty value asks for a feature this server lacks.
_UNSUPPORTED_WHEN_SET = (
    "logits_processors", "structural_tag", "logprob_token_ids", "repetition_detection", "mm_processor_kwargs",
    "kv_transfer_params", "ec_transfer_params", "guided_whitespace_pattern",
)


class LenientModel(BaseModel):
    """A request body (or part of one) whose undeclared keys are dropped, their names kept in
    `ignored_keys` (vLLM logs and ignores them; OpenAI refuses them)."""

    model_config = ConfigDict(extra="ignore")
    _ignored_keys: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored_keys(cls, data: Any, handler: Any) -> Any:
        model = handler(data)
        if isinstance(data, dict) and isinstance(model, LenientModel):
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            model._ignored_keys = [str(key) for key in data if key not in known]
        return model

    @property
    def ignored_keys(self) -> list[str]:
        """This model's own undeclared keys, in the order they came."""
        return self._ignored_keys


class VllmGenerationFields(LenientModel):
    """vLLM's extension fields shared by chat and text completions."""

    # Beam search is not implemented: accepted while off; its knobs then change nothing (as in vLLM).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    best_of: int | None = None
    watermarking: bool | None = None
    # Keep the prompt's last k tokens ("left", the default) or its first ("right"); -1: max_model_len.
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    # Used in the response id and the engine's request ids (vLLM: "chatcmpl-{request_id}").
    request_id: str | None = Field(default=None, max_length=MAX_CLIENT_REQUEST_ID_CHARS)
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    echo: bool = False
    # vLLM's older names for structured_outputs' kinds (structured_outputs.py reads them).
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: Any = None
    # Settings for engine extensions: vLLM puts them in SamplingParams.extra_args (so does sampling.py);
    # this engine reads none of them.
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    # Refused when set (see _UNSUPPORTED_WHEN_SET), or with values that ask for what is not here.
    logits_processors: Any = None
    logprob_token_ids: list[int] | None = None
    repetition_detection: Any = None
    thinking_token_budget: int | None = None  # -1: unlimited, as unset (vLLM)
    mm_processor_kwargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # the gateway runs prefill/decode disaggregation itself
    ec_transfer_params: dict[str, Any] | None = None
    # Hints and render-only flags that change nothing on a generation route here.
    session_id: str | None = None
    stream_interval: Annotated[int, Field(ge=1)] | None = None  # every token is streamed as it comes
    routed_experts_prompt_start: Annotated[int, Field(ge=0)] = 0
    return_token_offsets: bool | None = None
    return_mm_kwargs: bool = True

    def vllm_unsupported_field(self) -> str | None:
        """The first vLLM field whose value asks for what this server lacks, if any."""
        if self.use_beam_search:
            return "use_beam_search"
        if self.watermarking:
            return "watermarking"
        for name in _UNSUPPORTED_WHEN_SET:
            if getattr(self, name) not in (None, [], {}):
                return name
        if self.thinking_token_budget not in (None, -1):
            return "thinking_token_budget"
        backend = self.guided_decoding_backend
        if backend is not None and backend.split(":")[0] not in STRUCTURED_OUTPUTS_BACKENDS:
            return "guided_decoding_backend"
        return None

    def guided_fields(self) -> dict[str, Any]:
        """The guided_* constraint fields given (name: value)."""
        return {name: getattr(self, name) for name in GUIDED_FIELDS if getattr(self, name) is not None}


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class VllmChatFields(LenientModel):
    """vLLM's extension fields of chat completions only."""

    # Passed to the chat template (chat_template_kwargs), as vLLM does.
    reasoning_effort: ReasoningEffort | None = None
    documents: list[dict[str, str]] | None = None
    # Special tokens on top of those the chat template places (vLLM's default: none).
    add_special_tokens: bool = False
    return_prompt_text: bool | None = None
    include_reasoning: bool = True  # no reasoning parser here: reasoning stays in the content
    chat_template: str | None = None  # a request's own template: refused, as vLLM does by default
    media_io_kwargs: dict[str, Any] | None = None

    def vllm_chat_unsupported_field(self) -> str | None:
        for name in ("chat_template", "media_io_kwargs"):
            if getattr(self, name) not in (None, {}):
                return name
        return None
