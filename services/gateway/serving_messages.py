"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, as vLLM serves it.

A Messages request is translated into a chat request (the system prompt first, `tool_use`
blocks into assistant `tool_calls`, `tool_result` blocks into `role: "tool"` messages, tools
into functions, tool_choice any / tool into "required" / a named function) and then runs
exactly as /v1/chat/completions does (`serving_chat.prepare_chat`): the same checks, chat
template, sampling params, tool plan and parsers, routing and migration. Only the output is
shaped differently: content blocks (text, then tool_use) and Anthropic's stop reasons, or its
SSE events (`event: <type>` + `data: <json>`).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi.responses import Response
from pydantic import ValidationError
from starlette.requests import Request

from services.gateway.context import GatewayContext
from services.gateway.errors import anthropic_error_body, as_openai_error, invalid_request, unsupported
from services.gateway.protocol import ChatCompletionRequest, DeltaToolCall
from services.gateway.protocol_anthropic import (
    ContentBlock,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    ConversationRequest,
    CountTokensRequest,
    CountTokensResponse,
    InputJsonDelta,
    MessageDelta,
    MessageDeltaEvent,
    MessageParam,
    MessagesRequest,
    MessagesResponse,
    MessageStartEvent,
    MessageStopEvent,
    PingEvent,
    StopReason,
    StreamEvent,
    TextBlock,
    TextBlockParam,
    TextDelta,
    ToolUseBlock,
    Usage,
)
from services.gateway.serving_chat import prepare_chat, render_chat_request, start_chat, stream_piece
from services.gateway.sse import json_response, sse_response
from services.gateway.tool_parsers import StreamPiece, ToolCallParser
from services.gateway.tools import ToolPlan
from services.text.output_processor import ChoiceDelta


async def create_message(ctx: GatewayContext, request: MessagesRequest,
                         http_request: Request | None = None) -> Response:
    """Serve one Messages request (streamed or whole)."""
    arrival_time = time.monotonic()
    chat_request = to_chat_request(request)
    chat = await prepare_chat(ctx, chat_request)
    message_id = f"msg_{uuid.uuid4().hex}"
    deltas = await start_chat(ctx, chat_request, chat, message_id, http_request, arrival_time)
    writer = _MessageWriter(ctx, message_id, len(chat.prompt.token_ids), chat.tools)
    if request.stream:
        return sse_response(writer.stream(deltas), on_error=lambda e: [_error_event(e)])
    return json_response(await writer.collect(deltas))


async def count_tokens(ctx: GatewayContext, request: CountTokensRequest) -> CountTokensResponse:
    """The prompt's length in tokens, rendered exactly as a Messages request would be."""
    prompt = await render_chat_request(ctx, to_chat_request(request))
    return CountTokensResponse(input_tokens=len(prompt.token_ids))


# ---------------------------------------------------------------------- request translation


def _text_parts(blocks: list[TextBlockParam]) -> list[dict[str, Any]]:
    # Content parts, as the chat path takes them (prompts.py joins them with newlines).
    return [{"type": "text", "text": block.text} for block in blocks]


def _chat_messages(message: MessageParam) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages, in block order: a user turn's tool results
    become `tool` messages between its text parts; an assistant turn's tool_use blocks become
    its `tool_calls` (arguments as JSON text, as OpenAI's clients send them)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "assistant":
        texts = [b for b in message.content if b.type == "text"]
        calls = [{"id": b.id, "type": "function",
                  "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                 for b in message.content if b.type == "tool_use"]
        if any(b.type == "tool_result" for b in message.content):
            raise invalid_request("tool_result blocks belong in user messages", param="messages")
        turn: dict[str, Any] = {"role": "assistant", "content": _text_parts(texts) if texts else None}
        if calls:
            turn["tool_calls"] = calls
        return [turn]
    out: list[dict[str, Any]] = []
    pending: list[TextBlockParam] = []
    for block in message.content:
        if block.type == "text":
            pending.append(block)
        elif block.type == "tool_result":
            if pending:
                out.append({"role": "user", "content": _text_parts(pending)})
                pending = []
            result = block.content
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _text_parts(result) if isinstance(result, list) else (result or "")})
        else:
            raise invalid_request("tool_use blocks belong in assistant messages", param="messages")
    if pending or not out:
        out.append({"role": "user", "content": _text_parts(pending)})
    return out


def _tool_choice(request: ConversationRequest) -> Any:
    choice = request.tool_choice
    if choice is None:
        return None  # with tools: "auto", Anthropic's default and the chat path's
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def to_chat_request(request: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that runs `request` (a 400 naming what cannot be translated)."""
    if request.thinking is not None and request.thinking.type != "disabled":
        raise unsupported("thinking")
    messages: list[dict[str, Any]] = []
    if request.system:
        system = request.system
        messages.append({"role": "system", "content": system if isinstance(system, str) else _text_parts(system)})
    for message in request.messages:
        messages += _chat_messages(message)
    # A final assistant turn is a prefill (Anthropic's rule): the reply continues its text.
    prefill = request.messages[-1].role == "assistant"
    body: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "add_generation_prompt": not prefill,
        "continue_final_message": prefill,
        "chat_template_kwargs": request.chat_template_kwargs,
        "tool_choice": _tool_choice(request),
    }
    if request.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in request.tools]
    if request.tool_choice is not None and request.tool_choice.disable_parallel_tool_use:
        body["parallel_tool_calls"] = False
    if isinstance(request, MessagesRequest):
        body.update(max_tokens=request.max_tokens, stop=request.stop_sequences, temperature=request.temperature,
                    top_p=request.top_p, top_k=request.top_k, stream=request.stream)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # bounds the chat request has and the Anthropic one does not
        first = e.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise invalid_request(f"{where}: {first.get('msg')}" if where else str(first.get("msg"))) from None


# ---------------------------------------------------------------------- responses


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex}"


def _tool_input(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as the tool_use input object; None when they are not one (cut short)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _stop(ending: ChoiceDelta | None, called: bool) -> tuple[StopReason | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for how the reply ended."""
    if ending is None:
        return None, None
    if ending.finish_reason == "length":
        return "max_tokens", None
    if called:  # a forced tool (tool_choice "tool") too: OpenAI says "stop", Anthropic "tool_use"
        return "tool_use", None
    if isinstance(ending.stop_reason, str):  # a stop string (a token id stop is the end of the turn)
        return "stop_sequence", ending.stop_reason
    return "end_turn", None


def sse_event(event: StreamEvent) -> str:
    """One Anthropic SSE event: its type on the `event:` line, the JSON on the `data:` line."""
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"


def _error_event(error: Exception) -> str:
    return f"event: error\ndata: {json.dumps(anthropic_error_body(as_openai_error(error)))}\n\n"


class _StreamBlocks:
    """Turns a reply's stream pieces into content-block events: a text block while text
    comes, a tool_use block per call (its input as JSON fragments), each closed before the next."""

    def __init__(self) -> None:
        self._index = -1
        self._open: str | None = None  # the type of the block being written
        self.called = False

    def _start(self, block: ContentBlock) -> list[StreamEvent]:
        events = self.close()
        self._index += 1
        self._open = block.type
        return events + [ContentBlockStartEvent(index=self._index, content_block=block)]

    def close(self) -> list[StreamEvent]:
        if self._open is None:
            return []
        self._open = None
        return [ContentBlockStopEvent(index=self._index)]

    def feed(self, piece: StreamPiece) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if piece.content:
            if self._open != "text":
                events += self._start(TextBlock(text=""))
            events.append(ContentBlockDeltaEvent(index=self._index, delta=TextDelta(text=piece.content)))
        for call in piece.tool_calls:
            events += self._tool_call(call)
        return events

    def _tool_call(self, call: DeltaToolCall) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        function = call.function
        if call.id is not None:  # a new call: its name comes first
            self.called = True
            events += self._start(ToolUseBlock(id=_tool_use_id(), name=function.name if function else "", input={}))
        if self._open == "tool_use" and function is not None and function.arguments:
            events.append(ContentBlockDeltaEvent(index=self._index,
                                                 delta=InputJsonDelta(partial_json=function.arguments)))
        return events


class _MessageWriter:
    """Shapes one reply's deltas as an Anthropic message or its stream of events."""

    def __init__(self, ctx: GatewayContext, message_id: str, num_prompt_tokens: int, tools: ToolPlan | None) -> None:
        self._ctx = ctx
        self._id = message_id
        self._num_prompt_tokens = num_prompt_tokens
        self._num_output_tokens = 0
        # The tool-call parser of the plan (None: no tool calling); Messages have one reply.
        self._parser: ToolCallParser | None = tools.new_parser() if tools and tools.new_parser else None

    def _usage(self) -> Usage:
        return Usage(input_tokens=self._num_prompt_tokens, output_tokens=self._num_output_tokens)

    def _message(self, content: list[ContentBlock], ending: ChoiceDelta | None, called: bool) -> MessagesResponse:
        stop_reason, stop_sequence = _stop(ending, called)
        return MessagesResponse(id=self._id, model=self._ctx.served_model_name, content=content,
                                stop_reason=stop_reason, stop_sequence=stop_sequence, usage=self._usage())

    async def collect(self, deltas: AsyncGenerator[ChoiceDelta, None]) -> MessagesResponse:
        texts: list[str] = []
        ending: ChoiceDelta | None = None
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                self._num_output_tokens += len(delta.token_ids)
                texts.append(delta.text)
                if delta.finish_reason:
                    ending = delta
        text, calls = "".join(texts), []
        if self._parser is not None:
            extracted = self._parser.extract(text)
            text, calls = extracted.content or "", extracted.tool_calls
        content: list[ContentBlock] = [TextBlock(text=text)] if text else []
        for call in calls:
            arguments = _tool_input(call.function.arguments)
            if arguments is None:  # not an object (a forced call cut short): show what was written
                content.append(TextBlock(text=call.function.arguments))
            else:
                content.append(ToolUseBlock(id=_tool_use_id(), name=call.function.name, input=arguments))
        return self._message(content, ending, any(block.type == "tool_use" for block in content))

    async def stream(self, deltas: AsyncGenerator[ChoiceDelta, None]) -> AsyncIterator[str]:
        blocks = _StreamBlocks()
        ending: ChoiceDelta | None = None
        async with contextlib.aclosing(deltas):
            try:
                yield sse_event(MessageStartEvent(message=self._message([], None, False)))
                yield sse_event(PingEvent())
                async for delta in deltas:
                    self._num_output_tokens += len(delta.token_ids)
                    for event in blocks.feed(stream_piece(self._parser, delta)):
                        yield sse_event(event)
                    if delta.finish_reason:
                        ending = delta
                for event in blocks.close():
                    yield sse_event(event)
                stop_reason, stop_sequence = _stop(ending, blocks.called)
                yield sse_event(MessageDeltaEvent(delta=MessageDelta(stop_reason=stop_reason,
                                                                     stop_sequence=stop_sequence),
                                                  usage=self._usage()))
                yield sse_event(MessageStopEvent())
            except Exception as e:  # the status line is already sent: report in-band, as Anthropic does
                yield _error_event(e)
