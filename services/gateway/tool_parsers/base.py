"""What every tool-call parser does: split a model's output into content and tool calls,
whole (a non-streamed response) or piece by piece (a stream of deltas)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.gateway.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def arguments_text(arguments: Any) -> str:
    """OpenAI's `arguments` is JSON text; models write an object (or already a string)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def json_value_end(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON object or array starting at `start`; None while it is unfinished."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


@dataclass
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class StreamPiece:
    """What one stream step adds: content text and tool-call deltas (either may be empty)."""

    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


class ToolCallParser:
    """Base class: one instance per choice (a streaming parser keeps state between deltas)."""

    def __init__(self) -> None:
        self.num_calls = 0  # tool calls started so far in the stream

    def extract(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def feed(self, delta_text: str) -> StreamPiece:
        raise NotImplementedError

    def finish(self) -> StreamPiece:
        """The end of the stream: whatever was held back."""
        return StreamPiece()

    def _start_call(self, name: str, arguments: str = "") -> DeltaToolCall:
        """The first delta of a new tool call: its index, id, type and name."""
        delta = DeltaToolCall(index=self.num_calls, id=tool_call_id(), type="function",
                              function=DeltaFunctionCall(name=name, arguments=arguments))
        self.num_calls += 1
        return delta

    def _arguments(self, fragment: str) -> DeltaToolCall:
        """A further argument fragment of the latest tool call."""
        return DeltaToolCall(index=self.num_calls - 1, function=DeltaFunctionCall(arguments=fragment))


def whole_call(name: str, arguments: Any) -> ToolCall:
    return ToolCall(id=tool_call_id(), function=FunctionCall(name=name, arguments=arguments_text(arguments)))
