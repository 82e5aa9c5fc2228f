"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Field names and defaults follow OpenAI, plus vLLM's extensions (top_k, min_p,
repetition_penalty, stop_token_ids, ... and those of protocol_vllm.py). Chat and completions
bodies take what vLLM's server takes: a key no model declares is ignored and logged, as vLLM
does (a 400 naming it under --strict-request-fields, OpenAI's answer; request_fields.py), and
a known-but-unimplemented feature is refused by name, so a setting is never silently dropped
where it would matter. The few OpenAI fields that change nothing here (`user`, `store`,
`metadata`, ...) are declared and ignored. The other routes' bodies (tokenize, embeddings)
refuse undeclared keys.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from services.gateway.protocol_vllm import LenientModel, VllmChatFields, VllmGenerationFields

# Integers that travel in int32 / int64 proto fields: out-of-range values must be a 400
# naming the field, not an encoding error deep in the gRPC client.
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]

# ---------------------------------------------------------------------- requests


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(LenientModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # with include_usage: usage so far on every chunk (vLLM)
    include_obfuscation: bool | None = None  # OpenAI's padding of stream events: accepted, none is added


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Extra keys (tool_call_id, ...) travel on to the chat template untouched.
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class FunctionDefinition(LenientModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # OpenAI's exact-schema flag: accepted; arguments are not constrained


class ChatCompletionToolParam(LenientModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(LenientModel):
    name: str


class NamedToolChoice(LenientModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class GenerationRequest(VllmGenerationFields):
    """Fields shared by chat and text completions."""

    model: str | None = None
    n: Int32 = 1
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int32] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: Int32 = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    bad_words: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI fields that change nothing here: accepted and ignored.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # prefix-cache routing needs no hint
    safety_identifier: str | None = None
    priority: Int32 = 0
    cache_salt: str | None = None

    # Constrained decoding: OpenAI's response_format ({"type": "json_object"} or "json_schema")
    # and vLLM's structured_outputs ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's extension: each prompt token's logprob and top k (`prompt_logprobs` in the response).
    prompt_logprobs: Int32 | None = None

    def unsupported_field(self) -> str | None:
        """The first requested feature this server does not implement, if any."""
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return self.vllm_unsupported_field()

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far
        (only together with include_usage, as in vLLM)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(GenerationRequest, VllmChatFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None

    def unsupported_field(self) -> str | None:
        for name in ("functions", "function_call", "audio", "prediction"):
            if getattr(self, name) not in (None, [], {}):
                return name
        if self.modalities not in (None, ["text"]):
            return "modalities"
        return self.vllm_chat_unsupported_field() or super().unsupported_field()


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(GenerationRequest):
    prompt: PromptInput
    # OpenAI's and vLLM's default for text completions; an explicit null means "the rest of
    # the context" (the chat endpoint's default).
    max_tokens: Int32 | None = 16
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # BOS and the like before each text prompt (vLLM's default)
    prompt_embeds: Any = None  # vLLM's embeddings-as-prompt: not implemented

    def unsupported_field(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.prompt_embeds not in (None, [], ""):
            return "prompt_embeds"
        return super().unsupported_field()


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------- responses


def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class OmitNoneModel(BaseModel):
    """Serialised without its None fields (OpenAI stream deltas carry only what is present)."""

    @model_serializer(mode="wrap")
    def _only_present(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class VllmTokenFieldsModel(BaseModel):
    """A response with vLLM's on-request fields (`token_ids`, `prompt_token_ids`, `prompt_text`):
    serialised only when the request asked for them, so other responses keep OpenAI's shape."""

    @model_serializer(mode="wrap")
    def _requested_only(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None or k not in _ON_REQUEST_FIELDS}


_ON_REQUEST_FIELDS = frozenset({"token_ids", "prompt_token_ids", "prompt_text"})


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OmitNoneModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OmitNoneModel):
    """A streamed piece of tool call `index`: id, type and name first, then argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class AssistantMessage(BaseModel):
    role: str = "assistant"  # (--response-role may name another)
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(VllmTokenFieldsModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or stop token id
    token_ids: list[int] | None = None  # vLLM's return_token_ids: the choice's tokens


class ChatCompletionResponse(VllmTokenFieldsModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids
    prompt_text: str | None = None  # vLLM's return_prompt_text: the chat template's output


class DeltaMessage(OmitNoneModel):
    # OpenAI deltas carry only what changed: {"role": ...} first, then {"content": ...} or
    # {"tool_calls": [...]}, finally {}.
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(VllmTokenFieldsModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's tokens


class ChatCompletionChunk(VllmTokenFieldsModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on the first chunks only
    prompt_text: str | None = None  # return_prompt_text: on the first chunks only


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)

    def extend(self, other: CompletionLogprobs) -> None:
        """Append `other`'s entries (the next tokens) to these."""
        self.text_offset += other.text_offset
        self.token_logprobs += other.token_logprobs
        self.tokens += other.tokens
        self.top_logprobs += other.top_logprobs


class PromptLogprob(BaseModel):
    """vLLM's `Logprob` as JSON (prompt_logprobs entries are keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(VllmTokenFieldsModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # vLLM's return_token_ids (streamed: prompt_token_ids on a choice's first chunk only).
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "myvllm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str
