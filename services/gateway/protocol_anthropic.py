"""Request and response bodies of the Anthropic Messages API (`/v1/messages`, pydantic models).

Field names follow Anthropic's API. As on the OpenAI routes, a field no model here declares is a
400 naming it (Anthropic's own API refuses unknown fields too), so nothing is silently dropped:
the fields that change nothing here (`metadata`, `service_tier`, a block's `cache_control`) are
declared and ignored, and `thinking` is declared to be refused unless it is disabled. Content
blocks are text, `tool_use` (assistant) and `tool_result` (user); any other block type (images,
documents) is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.gateway.protocol import Int32

# ---------------------------------------------------------------------- requests


class AnthropicBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Anthropic's prompt-caching hint on any block or tool: our prefix cache needs none (accepted, ignored).
CacheControl = dict[str, Any] | None


class TextBlockParam(AnthropicBaseModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: list[dict[str, Any]] | None = None  # accepted, ignored


class ToolUseBlockParam(AnthropicBaseModel):
    """An earlier tool call of the assistant's (echoed back by the client)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl = None


class ToolResultBlockParam(AnthropicBaseModel):
    """The client's answer to the tool call `tool_use_id`."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: list[TextBlockParam] | str | None = None
    is_error: bool | None = None  # accepted; the result text says what went wrong
    cache_control: CacheControl = None


ContentBlockParam = Annotated[TextBlockParam | ToolUseBlockParam | ToolResultBlockParam, Field(discriminator="type")]


class MessageParam(AnthropicBaseModel):
    role: Literal["user", "assistant"]
    # The list first: a bad block's error is the one reported, not "not a string".
    content: list[ContentBlockParam] | str


class ToolParam(AnthropicBaseModel):
    name: str = Field(min_length=1, max_length=256)  # the chat path's bound on a function name
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl = None


class ToolChoice(AnthropicBaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_iff_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('a name is required with type "tool", and only with it')
        return self


class ThinkingConfig(AnthropicBaseModel):
    """Extended thinking: declared so that asking for it is a 400 naming it (no reasoning parser here)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Int32 | None = None


class ConversationRequest(AnthropicBaseModel):
    """What a Messages request and a token count share: the conversation and the tools."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: list[TextBlockParam] | str | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    cache_control: CacheControl = None  # automatic prompt caching: accepted, ignored
    # vLLM's extension: more arguments for the chat template.
    chat_template_kwargs: dict[str, Any] | None = None


class MessagesRequest(ConversationRequest):
    max_tokens: Int32  # required, as Anthropic requires it
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    stream: bool = False
    # Anthropic fields that change nothing here: accepted and ignored.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


class CountTokensRequest(ConversationRequest):
    pass


# ---------------------------------------------------------------------- responses


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ToolUseBlock
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int


# Stream events: `event: <type>` lines whose data is one of these, in this order: message_start,
# ping, then per content block content_block_start / _delta... / _stop, message_delta, message_stop.


class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: MessagesResponse


class PingEvent(BaseModel):
    type: Literal["ping"] = "ping"


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(BaseModel):
    """A fragment of a tool_use block's input, as JSON text (the fragments join to the object)."""

    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJsonDelta


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(BaseModel):
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: Usage  # totals so far (Anthropic's message_delta usage is cumulative)


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


StreamEvent = (MessageStartEvent | PingEvent | ContentBlockStartEvent | ContentBlockDeltaEvent | ContentBlockStopEvent
               | MessageDeltaEvent | MessageStopEvent)
