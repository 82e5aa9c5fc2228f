"""Request, response and stream-event bodies of OpenAI's Responses API (`POST /v1/responses`).

Shapes follow the official client's types (`openai/types/responses`). As on the other routes
(protocol.py), a body field no model here declares is a 400 naming it, OpenAI features this
server does not run are declared only to be refused by name (`unsupported_field`), and the
fields that change nothing here (`user`, `metadata`, `service_tier`, ...) are accepted.

`input` items and `tools` arrive as plain objects and are validated one at a time by the handler
against `INPUT_ITEMS` / `FunctionTool`: an error then names the item (`input[2].call_id`), and an
item or tool type this server does not run (images, reasoning, web search) is a 400 naming its
`type` rather than a union's list of every member that did not match. Items echoed back from an
earlier response's `output` carry fields of their own (`id`, `status`, `annotations`, ...), so
input items accept and ignore unknown keys.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.protocol import ContentPart, Int32, Int64, OpenAIBaseModel

# ---------------------------------------------------------------------- requests


class FunctionTool(OpenAIBaseModel):
    """A function tool, in the Responses API's flat shape (no nested `function` object)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # as on chat: accepted; the arguments follow the schema only when constrained


class ToolChoiceFunction(OpenAIBaseModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIBaseModel):
    """`text.format`: plain text, any JSON object, or JSON following `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    # `schema` would shadow BaseModel's deprecated method of that name.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIBaseModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesStreamOptions(OpenAIBaseModel):
    include_obfuscation: bool | None = None  # OpenAI's padding of stream events: accepted, none is added


class ResponsesRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    # Only built-in tools count against it, and there are none here: nothing to limit.
    max_tool_calls: Int32 | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # OpenAI fields that change nothing here: accepted and ignored (metadata is echoed).
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # vLLM's sampling and scheduling extensions, as on chat completions.
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: Int64 | None = None
    priority: Int32 = 0
    cache_salt: str | None = None
    # Declared only to be refused (see `unsupported_field`).
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    include: list[str] | None = None
    top_logprobs: Int32 | None = None
    context_management: Any = None

    def unsupported_field(self) -> str | None:
        """The first requested feature this server does not implement, if any."""
        if self.background:
            return "background"  # responses are served while the client waits, never queued
        for name in ("conversation", "prompt", "reasoning", "include", "context_management"):
            if getattr(self, name) not in (None, [], {}):
                return name
        if self.top_logprobs:
            return "top_logprobs"
        if self.truncation == "auto":
            return "truncation"  # an input too long for the context is a 400, never cut
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            return "text.verbosity"
        return None


class InputMessage(BaseModel):
    """A message item (`type` may be left out): user, system or developer input, or an assistant turn."""

    model_config = ConfigDict(extra="allow")

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]


class FunctionCallInput(BaseModel):
    """A function call the model made earlier (an earlier response's output item, sent back)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputInput(BaseModel):
    """The client's result of function call `call_id`."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


# Input item types by their `type` (a message may leave it out).
INPUT_ITEMS: dict[str, type[BaseModel]] = {
    "message": InputMessage, "function_call": FunctionCallInput, "function_call_output": FunctionCallOutputInput,
}

# ---------------------------------------------------------------------- responses

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class FunctionCallOutputItem(BaseModel):
    """A function call in a response's output (`call_id` is what the client's result refers to)."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # JSON text
    status: ItemStatus


OutputItem = OutputMessage | FunctionCallOutputItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponsesResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    model: str
    instructions: str | None = None
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    usage: ResponseUsage | None = None


# ---------------------------------------------------------------------- stream events
# Each carries its `sequence_number` (its place in the stream, from 0), as the client's types require.


class ResponseLifecycleEvent(BaseModel):
    type: Literal["response.created", "response.in_progress", "response.completed"]
    sequence_number: int
    response: ResponsesResponse


class OutputItemEvent(BaseModel):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(BaseModel):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDeltaEvent(BaseModel):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class OutputTextDoneEvent(BaseModel):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class FunctionCallArgumentsDeltaEvent(BaseModel):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(BaseModel):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(BaseModel):
    """A failure after the stream began (the status line is already sent)."""

    type: Literal["error"] = "error"
    sequence_number: int
    code: str | None = None
    message: str
    param: str | None = None

