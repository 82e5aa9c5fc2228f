"""The Hermes tool-call format (Qwen and many others): the model writes
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of times, after
optional plain content. `--tool-call-parser hermes`.

Streaming: content flows until a `<tool_call>` tag begins (a partial tag is held back);
each tool call is sent once its closing tag arrives, as one delta with its whole arguments.
"""

from __future__ import annotations

import json
import re

from services.gateway.tool_parsers.base import (
    ExtractedToolCalls,
    StreamPiece,
    ToolCallParser,
    arguments_text,
    whole_call,
)

START, END = "<tool_call>", "</tool_call>"
_CALLS = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one tool call's body, or None if it is not one."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return call["name"], arguments_text(call.get("arguments", {}))


def _held_back(text: str) -> int:
    """How many trailing characters of `text` could be the start of a `<tool_call>` tag."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


class HermesToolParser(ToolCallParser):
    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""      # text not yet sent (a partial tag, or an unfinished tool call)
        self._in_call = False

    def extract(self, text: str) -> ExtractedToolCalls:
        if START not in text:
            return ExtractedToolCalls(content=text)
        calls = [_parse_call(body) for body in _CALLS.findall(text)]
        if not calls or any(c is None for c in calls):
            return ExtractedToolCalls(content=text)  # not a well-formed call: the text is the answer
        content = text[:text.index(START)].strip()
        return ExtractedToolCalls(content=content or None, tool_calls=[whole_call(n, a) for n, a in calls])

    def feed(self, delta_text: str) -> StreamPiece:
        self._buffer += delta_text
        piece = StreamPiece()
        while self._buffer:
            if not self._in_call:
                start = self._buffer.find(START)
                if start < 0:
                    keep = _held_back(self._buffer)
                    self._content(self._buffer[:len(self._buffer) - keep], piece)
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                self._content(self._buffer[:start], piece)
                self._buffer = self._buffer[start + len(START):]
                self._in_call = True
            end = self._buffer.find(END)
            if end < 0:
                break
            self._emit(self._buffer[:end], piece)
            self._buffer = self._buffer[end + len(END):]
            self._in_call = False
        return piece

    def _content(self, text: str, piece: StreamPiece) -> None:
        if self.num_calls and not text.strip():
            return  # whitespace between or after tool calls is not content
        piece.content += text

    def finish(self) -> StreamPiece:
        piece = StreamPiece()
        if self._in_call:
            self._emit(self._buffer, piece)  # an unclosed last call (the model stopped after it)
        else:
            self._content(self._buffer, piece)
        self._buffer, self._in_call = "", False
        return piece

    def _emit(self, body: str, piece: StreamPiece) -> None:
        call = _parse_call(body)
        if call is None:
            piece.content += START + body  # not a tool call after all: show it as text
            return
        piece.tool_calls.append(self._start_call(call[0], call[1]))
