"""POST /v1/responses: OpenAI's Responses API, served by the chat path.

A Responses request becomes a chat completions request: `instructions` a system message first,
then the conversation of `previous_response_id` (if any), then `input` (messages; function calls
as an assistant turn's `tool_calls`; their results as `tool` messages); the flat function tools
become chat tools and `text.format` becomes `response_format`. That request goes through the chat
path's own steps (`prepare_chat`: checks, tool plan, output constraint, chat template, sampling
params; `start_chat`: routing and generation, counted in the same metrics), so both endpoints
render, constrain and sample alike. Only the output's shape differs: output items (a `message`
with `output_text`, `function_call`s read by the same tool-call parsers) and, streamed, the typed
events the official client assembles (`response.created` ... `response.completed`).

`previous_response_id` reads a bounded, in-memory store of this gateway's recent responses
(`ResponseStore`): lost on restart, not shared between gateways.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from services.common.param_errors import SamplingParamsError
from services.gateway.context import GatewayContext
from services.gateway.errors import OpenAIError, as_openai_error, invalid_request, unsupported, validation_error
from services.gateway.protocol import (
    ChatCompletionRequest,
    ChatCompletionToolParam,
    ChatMessage,
    ContentPart,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
)
from services.gateway.protocol_responses import (
    INPUT_ITEMS,
    ContentPartEvent,
    ErrorEvent,
    FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent,
    FunctionCallInput,
    FunctionCallOutputItem,
    FunctionTool,
    IncompleteDetails,
    InputMessage,
    InputTokensDetails,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    OutputTextDeltaEvent,
    OutputTextDoneEvent,
    ResponseLifecycleEvent,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
    TextConfig,
    ToolChoiceFunction,
)
from services.gateway.serving_chat import PreparedChat, prepare_chat, start_chat, stream_piece
from services.gateway.sse import json_response, sse_event, sse_response
from services.gateway.tool_parsers import StreamPiece, ToolCallParser
from services.text.output_processor import ChoiceDelta

# The store's bounds: responses kept, and characters of their conversations all together (each
# counted whole, though follow-ups share their history's messages: an overestimate, so a safe bound).
MAX_STORED_RESPONSES = 1024
MAX_STORED_CHARS = 32 * 1024 * 1024

M = TypeVar("M", bound=BaseModel)

# ---------------------------------------------------------------------- the store


@dataclass(frozen=True)
class Conversation:
    """Chat messages of a conversation so far (without instructions: they are not carried over,
    as in OpenAI's API) and their size in characters."""

    messages: tuple[ChatMessage, ...] = ()
    chars: int = 0

    def extended(self, messages: list[ChatMessage]) -> Conversation:
        return Conversation(self.messages + tuple(messages), self.chars + _chars(messages))


def _chars(messages: list[ChatMessage]) -> int:
    total = 0
    for message in messages:
        total += len(message.content) if isinstance(message.content, str) else 0
        for call in getattr(message, "tool_calls", None) or []:
            total += len(call["function"]["name"]) + len(call["function"]["arguments"])
    return total


@dataclass(frozen=True)
class _Stored:
    conversation: Conversation          # what a follow-up (previous_response_id) continues
    response: ResponsesResponse | None  # what GET /v1/responses/{id} returns
    chars: int                          # what it counts against the store's bound


class ResponseStore:
    """This gateway's most recent stored responses (their objects and the conversations that led to
    them), by response id: an LRU bounded in entries and characters, in memory (lost on restart,
    one per gateway)."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_chars: int = MAX_STORED_CHARS) -> None:
        self._max_responses = max_responses
        self._max_chars = max_chars
        self._entries: OrderedDict[str, _Stored] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _use(self, response_id: str) -> _Stored | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)  # one in use stays
        return entry

    def get(self, response_id: str) -> Conversation | None:
        """The conversation a follow-up of `response_id` continues."""
        entry = self._use(response_id)
        return entry.conversation if entry is not None else None

    def response(self, response_id: str) -> ResponsesResponse | None:
        entry = self._use(response_id)
        return entry.response if entry is not None else None

    def put(self, response_id: str, conversation: Conversation, response: ResponsesResponse | None = None) -> None:
        chars = conversation.chars + (len(response.model_dump_json()) if response is not None else 0)
        if chars > self._max_chars:
            return  # it would push out everything else and still not fit
        self.delete(response_id)
        self._entries[response_id] = _Stored(conversation, response, chars)
        self._chars += chars
        while len(self._entries) > self._max_responses or self._chars > self._max_chars:
            _, evicted = self._entries.popitem(last=False)
            self._chars -= evicted.chars

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._chars -= entry.chars
        return entry is not None


# ---------------------------------------------------------------------- request -> chat request


def _validated(model: type[M], value: Any, location: tuple[str | int, ...]) -> M:
    """`value` as `model`; a 400 naming the bad field under `location` (as body validation does)."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        errors = [{**error, "loc": ("body", *location, *error["loc"])} for error in e.errors()]
        raise validation_error(RequestValidationError(errors)) from None


def _text(content: str | list[ContentPart], param: str) -> str:
    """A message's text: its string, or its text parts joined (as the chat path joins them)."""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if part.type not in ("input_text", "output_text") or part.text is None:
            raise unsupported(f"Content part type {part.type!r}", param=f"{param}[{i}].type")
        texts.append(part.text)
    return "\n".join(texts)


def _input_messages(input_: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """`input` as chat messages."""
    if isinstance(input_, str):
        return [ChatMessage(role="user", content=input_)]
    messages: list[ChatMessage] = []
    for i, raw in enumerate(input_):
        kind = raw.get("type", "message")
        if not isinstance(kind, str) or kind not in INPUT_ITEMS:
            raise unsupported(f"Input item type {kind!r}", param=f"input[{i}].type")
        item = _validated(INPUT_ITEMS[kind], raw, ("input", i))
        if isinstance(item, InputMessage):
            # "developer" is OpenAI's new name for the system role; chat templates know "system".
            role = "system" if item.role == "developer" else item.role
            messages.append(ChatMessage(role=role, content=_text(item.content, f"input[{i}].content")))
        elif isinstance(item, FunctionCallInput):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                # Calls that follow an assistant turn (or each other) belong to that one turn.
                messages[-1] = ChatMessage(role="assistant", content=last.content,
                                           tool_calls=[*(getattr(last, "tool_calls", None) or []), call])
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                        content=_text(item.output, f"input[{i}].output")))
    return messages


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[ChatCompletionToolParam] | None:
    """The flat function tools as the chat path's tool objects."""
    if tools is None:
        return None
    converted = []
    for i, raw in enumerate(tools):
        if raw.get("type") != "function":
            raise unsupported(f"Tool type {raw.get('type')!r}", param=f"tools[{i}].type")
        tool = _validated(FunctionTool, raw, ("tools", i))
        converted.append(ChatCompletionToolParam(function=FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict)))
    return converted


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | NamedToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function":
        raise unsupported(f"tool_choice type {choice.get('type')!r}", param="tool_choice.type")
    return NamedToolChoice(function=NamedFunction(name=_validated(ToolChoiceFunction, choice, ("tool_choice",)).name))


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (checked, and parsed, by the chat path)."""
    format_ = text.format if text is not None else None
    if format_ is None or format_.type == "text":
        return None
    if format_.type == "json_object":
        return {"type": "json_object"}
    if format_.json_schema is None:
        raise invalid_request("text.format of type 'json_schema' needs schema, a JSON schema object",
                              param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": format_.name or "response", "schema": format_.json_schema,
                                                   "strict": format_.strict}}


def _chat_request(request: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    if not messages:
        raise invalid_request("input must not be empty", param="input")
    return ChatCompletionRequest(
        model=request.model, messages=messages, max_tokens=request.max_output_tokens,
        temperature=request.temperature, top_p=request.top_p, top_k=request.top_k, min_p=request.min_p,
        repetition_penalty=request.repetition_penalty, seed=request.seed, priority=request.priority,
        cache_salt=request.cache_salt, stream=request.stream, tools=_chat_tools(request.tools),
        tool_choice=_chat_tool_choice(request.tool_choice), parallel_tool_calls=request.parallel_tool_calls,
        response_format=_response_format(request.text))


# What the chat path's errors call a field, and the Responses field it came from.
_CHAT_PARAMS = (("messages", "input"), ("response_format", "text.format"), ("max_tokens", "max_output_tokens"))


def _in_responses_terms(error: OpenAIError) -> OpenAIError:
    """`error` naming the Responses request's field rather than the chat request's."""
    param = error.param or ""
    for chat_name, name in _CHAT_PARAMS:
        if param == chat_name or param.startswith((f"{chat_name}.", f"{chat_name}[")):
            error.param = name
    return error


def _history(store: ResponseStore, previous_response_id: str | None) -> Conversation:
    if previous_response_id is None:
        return Conversation()
    conversation = store.get(previous_response_id)
    if conversation is None:
        raise OpenAIError(HTTPStatus.NOT_FOUND, f"Previous response with id '{previous_response_id}' not found. "
                          "(This gateway keeps its most recent responses in memory only.)",
                          param="previous_response_id", code="previous_response_not_found")
    return conversation


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(HTTPStatus.NOT_FOUND, f"Response with id '{response_id}' not found. (This gateway keeps "
                       "its most recent stored responses in memory only.)", param="response_id",
                       code="response_not_found")


def retrieve_response(store: ResponseStore, response_id: str) -> Response:
    """GET /v1/responses/{id}: a finished response created with store on (the default)."""
    response = store.response(response_id)
    if response is None:
        raise _not_found(response_id)
    return json_response(response)


def delete_response(store: ResponseStore, response_id: str) -> Response:
    """DELETE /v1/responses/{id}: forgotten, for retrieval and as a previous_response_id."""
    if not store.delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def create_response(ctx: GatewayContext, store: ResponseStore, request: ResponsesRequest,
                          http_request: Request | None = None) -> Response:
    arrival_time = time.monotonic()
    ctx.check_model(request.model)
    if (field := request.unsupported_field()) is not None:
        raise unsupported(field)
    history = _history(store, request.previous_response_id)
    new_messages = _input_messages(request.input)
    instructions = [ChatMessage(role="system", content=request.instructions)] if request.instructions else []
    chat_request = _chat_request(request, [*instructions, *history.messages, *new_messages])
    try:
        chat = await prepare_chat(ctx, chat_request)
    except (OpenAIError, SamplingParamsError) as e:
        raise _in_responses_terms(as_openai_error(e)) from None
    response_id = f"resp_{uuid.uuid4().hex}"
    deltas = await start_chat(ctx, chat_request, chat, response_id, http_request, arrival_time)
    writer = _ResponseWriter(ctx, store, request, response_id, chat, history.extended(new_messages))
    if request.stream:
        return sse_response(writer.stream(deltas), on_error=writer.error_events)
    return json_response(await writer.collect(deltas))


# ---------------------------------------------------------------------- output


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class _ResponseWriter:
    """Shapes one response's deltas as a `Response` object or its stream of events."""

    def __init__(self, ctx: GatewayContext, store: ResponseStore, request: ResponsesRequest, response_id: str,
                 chat: PreparedChat, conversation: Conversation) -> None:
        self._ctx = ctx
        self._store = store
        self._request = request
        self._id = response_id
        self._conversation = conversation  # what a follow-up continues, once the reply is added
        self._created_at = int(time.time())
        tools = chat.tools
        self._parser: ToolCallParser | None = tools.new_parser() if tools and tools.new_parser else None
        self._num_prompt_tokens = len(chat.prompt.token_ids)
        self._num_output_tokens = 0
        self._num_cached_tokens = 0
        self._output: list[OutputItem] = []  # finished output items, in order
        # Streaming: the item being streamed (not yet in _output) and its text or arguments so far.
        self._open: OutputMessage | FunctionCallOutputItem | None = None
        self._open_pieces: list[str] = []
        self._sequence_number = 0

    def _count(self, delta: ChoiceDelta) -> None:
        self._num_output_tokens += len(delta.token_ids)
        if delta.num_cached_tokens:
            self._num_cached_tokens = delta.num_cached_tokens

    def _response(self, status: str, usage: ResponseUsage | None = None,
                  finish_reason: str | None = None) -> ResponsesResponse:
        request = self._request
        text = request.text.model_dump(by_alias=True, exclude_none=True) if request.text is not None else {}
        return ResponsesResponse(
            id=self._id, created_at=self._created_at, status=status,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if finish_reason == "length" else None,
            model=self._ctx.response_model(request.model), instructions=request.instructions, output=list(self._output),
            parallel_tool_calls=request.parallel_tool_calls is not False, temperature=request.temperature,
            top_p=request.top_p, max_output_tokens=request.max_output_tokens,
            previous_response_id=request.previous_response_id, store=request.store is not False,
            text={"format": {"type": "text"}, **text},
            tool_choice=request.tool_choice if request.tool_choice is not None else "auto",
            tools=request.tools or [], metadata=request.metadata, user=request.user, usage=usage)

    def _finish(self, finish_reason: str | None) -> ResponsesResponse:
        """The final response, once every output item is done; stored for follow-ups unless store is false."""
        usage = ResponseUsage(input_tokens=self._num_prompt_tokens,
                              input_tokens_details=InputTokensDetails(cached_tokens=self._num_cached_tokens),
                              output_tokens=self._num_output_tokens,
                              total_tokens=self._num_prompt_tokens + self._num_output_tokens)
        response = self._response(_item_status(finish_reason), usage, finish_reason)
        if self._request.store is not False:
            self._store.put(self._id, self._conversation.extended([self._reply()]), response)
        return response

    def _reply(self) -> ChatMessage:
        """The output as the assistant turn a follow-up request's prompt shows."""
        text = "".join(part.text for item in self._output if isinstance(item, OutputMessage) for part in item.content)
        calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
                 for item in self._output if isinstance(item, FunctionCallOutputItem)]
        if calls:
            return ChatMessage(role="assistant", content=text or None, tool_calls=calls)
        return ChatMessage(role="assistant", content=text)

    async def collect(self, deltas: AsyncGenerator[ChoiceDelta, None]) -> ResponsesResponse:
        pieces: list[str] = []
        finish_reason = None
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                self._count(delta)
                pieces.append(delta.text)
                finish_reason = delta.finish_reason or finish_reason
        text = "".join(pieces)
        content, calls = text, []
        if self._parser is not None:
            extracted = self._parser.extract(text)
            content, calls = extracted.content, extracted.tool_calls
        status = _item_status(finish_reason)
        if content or not calls:
            self._output.append(OutputMessage(id=_new_id("msg"), status=status,
                                              content=[OutputText(text=content or "")]))
        self._output += [FunctionCallOutputItem(id=_new_id("fc"), call_id=_new_id("call"), name=call.function.name,
                                                arguments=call.function.arguments, status=status) for call in calls]
        return self._finish(finish_reason)

    # -------------------------------------------------------------- streaming

    def _event(self, event_type: type[BaseModel], **fields: Any) -> str:
        event = event_type(sequence_number=self._sequence_number, **fields)
        self._sequence_number += 1
        # OpenAI names each event on an `event:` line too (the client reads `type` in the data).
        return f"event: {event.type}\n{sse_event(event)}"

    def _open_message(self) -> list[str]:
        item = OutputMessage(id=_new_id("msg"), status="in_progress", content=[])
        self._open, self._open_pieces = item, []
        index = len(self._output)
        return [self._event(OutputItemEvent, type="response.output_item.added", output_index=index, item=item),
                self._event(ContentPartEvent, type="response.content_part.added", item_id=item.id,
                            output_index=index, content_index=0, part=OutputText(text=""))]

    def _open_call(self, name: str) -> list[str]:
        item = FunctionCallOutputItem(id=_new_id("fc"), call_id=_new_id("call"), name=name, arguments="",
                                      status="in_progress")
        self._open, self._open_pieces = item, []
        return [self._event(OutputItemEvent, type="response.output_item.added", output_index=len(self._output),
                            item=item)]

    def _close(self, status: str) -> list[str]:
        """The done events of the item being streamed (if any), which joins the output."""
        item, self._open = self._open, None
        if item is None:
            return []
        index, text = len(self._output), "".join(self._open_pieces)
        if isinstance(item, OutputMessage):
            part = OutputText(text=text)
            item = item.model_copy(update={"status": status, "content": [part]})
            events = [self._event(OutputTextDoneEvent, item_id=item.id, output_index=index, content_index=0, text=text),
                      self._event(ContentPartEvent, type="response.content_part.done", item_id=item.id,
                                  output_index=index, content_index=0, part=part)]
        else:
            item = item.model_copy(update={"status": status, "arguments": text})
            events = [self._event(FunctionCallArgumentsDoneEvent, item_id=item.id, output_index=index,
                                  name=item.name, arguments=text)]
        self._output.append(item)
        return [*events, self._event(OutputItemEvent, type="response.output_item.done", output_index=index,
                                     item=item)]

    def _stream_piece(self, piece: StreamPiece) -> list[str]:
        """The events of one piece of output: text extends the open message (opening one after
        a call), a tool call's first delta opens a function_call item, later ones add arguments."""
        events: list[str] = []
        if piece.content:
            if not isinstance(self._open, OutputMessage):
                events += self._close("completed")
                events += self._open_message()
            self._open_pieces.append(piece.content)
            events.append(self._event(OutputTextDeltaEvent, item_id=self._open.id, output_index=len(self._output),
                                      content_index=0, delta=piece.content))
        for call in piece.tool_calls:
            function = call.function
            if call.id is not None:  # a new call: id and name come first
                events += self._close("completed")
                events += self._open_call(function.name if function and function.name else "")
            if function is not None and function.arguments and isinstance(self._open, FunctionCallOutputItem):
                self._open_pieces.append(function.arguments)
                events.append(self._event(FunctionCallArgumentsDeltaEvent, item_id=self._open.id,
                                          output_index=len(self._output), delta=function.arguments))
        return events

    async def stream(self, deltas: AsyncGenerator[ChoiceDelta, None]) -> AsyncIterator[str]:
        async with contextlib.aclosing(deltas):
            try:
                for lifecycle in ("response.created", "response.in_progress"):
                    yield self._event(ResponseLifecycleEvent, type=lifecycle, response=self._response("in_progress"))
                finish_reason = None
                async for delta in deltas:
                    self._count(delta)
                    finish_reason = delta.finish_reason or finish_reason
                    for event in self._stream_piece(stream_piece(self._parser, delta)):
                        yield event
                if self._open is None and not self._output:
                    for event in self._open_message():  # an empty reply is an empty message, as when not streamed
                        yield event
                for event in self._close(_item_status(finish_reason)):
                    yield event
                yield self._event(ResponseLifecycleEvent, type="response.completed",
                                  response=self._finish(finish_reason))
            except Exception as e:  # the status line is already sent: report in-band, as OpenAI does
                for event in self.error_events(e):
                    yield event

    def error_events(self, e: Exception) -> list[str]:
        """How this stream ends on an error: the Responses API's error event."""
        error = as_openai_error(e)
        return [self._event(ErrorEvent, code=error.code or error.type, message=error.message, param=error.param)]
