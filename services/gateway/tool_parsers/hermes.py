"""The Hermes tool-call format (Qwen and many others): the model writes
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of times, after
optional plain content. `--tool-call-parser hermes`.

Streaming: content flows until a `<tool_call>` tag begins (a partial tag is held back). A call
written name first (the format's order) is announced (id, name) as soon as its name is
complete, then its arguments object streams as it grows; any other shape is sent whole, as one
delta, once its closing tag arrives.
"""

from __future__ import annotations

import json
import re

from services.gateway.tool_parsers.base import (
    ExtractedToolCalls,
    StreamPiece,
    ToolCallParser,
    arguments_text,
    json_value_end,
    whole_call,
)

START, END = "<tool_call>", "</tool_call>"
_CALLS = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
# A call's start up to its arguments object: `{"name": "f", "arguments": {`.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')


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
        self._buffer = ""      # text not yet consumed: a partial tag, or the current call's body
        self._in_call = False
        self._args_start = -1  # in the buffer: where the streaming call's arguments begin (-1: none yet)
        self._args_sent = 0    # ... and how far they were sent
        self._args_done = False

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
                self._in_call, self._args_start, self._args_done = True, -1, False
            if not self._stream_call(piece):
                break
        return piece

    def _stream_call(self, piece: StreamPiece) -> bool:
        """Advance the current call; True once it is closed (the buffer then holds what follows)."""
        if self._args_start < 0:
            head = _CALL_HEAD.match(self._buffer)
            if head is not None:
                piece.tool_calls.append(self._start_call(json.loads(head.group(1))))
                self._args_start = self._args_sent = head.end()
        if self._args_start >= 0 and not self._args_done:
            end = json_value_end(self._buffer, self._args_start)
            upto = len(self._buffer) if end is None else end
            if upto > self._args_sent:
                piece.tool_calls.append(self._arguments(self._buffer[self._args_sent:upto]))
                self._args_sent = upto
            self._args_done = end is not None
        close = self._buffer.find(END, self._args_sent if self._args_start >= 0 else 0)
        if close < 0:
            return False
        if self._args_start < 0:
            self._emit(self._buffer[:close], piece)  # not name-first: the whole call at once
        self._buffer = self._buffer[close + len(END):]
        self._in_call = False
        return True

    def _content(self, text: str, piece: StreamPiece) -> None:
        if self.num_calls and not text.strip():
            return  # whitespace between or after tool calls is not content
        piece.content += text

    def finish(self) -> StreamPiece:
        piece = StreamPiece()
        if self._in_call and self._args_start < 0:
            self._emit(self._buffer, piece)  # an unclosed last call (the model stopped after it)
        elif not self._in_call:
            self._content(self._buffer, piece)
        self._buffer, self._in_call = "", False
        return piece

    def _emit(self, body: str, piece: StreamPiece) -> None:
        call = _parse_call(body)
        if call is None:
            piece.content += START + body  # not a tool call after all: show it as text
            return
        piece.tool_calls.append(self._start_call(call[0], call[1]))
