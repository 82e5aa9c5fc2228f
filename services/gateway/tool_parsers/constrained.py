"""Tool calls the engine was constrained to write (tool_choice "required" or a named
function), so their shape is known exactly:

- a named function: the whole output is the function's arguments object;
- "required": a JSON array of `{"name": ..., "parameters": {...}}`, name before parameters,
  compact separators (services/gateway/tools.py builds that schema).

Streaming sends each call's id and name as soon as the name is complete, then its
arguments as they grow.
"""

from __future__ import annotations

import json
import re

from services.gateway.tool_parsers.base import (
    ExtractedToolCalls,
    StreamPiece,
    ToolCallParser,
    json_value_end,
    whole_call,
)

# The start of the next call in a "required" array, up to the first character of its parameters.
_CALL_HEAD = re.compile(r'[\s}]*[\[,]\s*\{"name":\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters":\s*')


class NamedFunctionParser(ToolCallParser):
    """tool_choice {"type": "function", "function": {"name": ...}}: the output is the arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def extract(self, text: str) -> ExtractedToolCalls:
        return ExtractedToolCalls(content=None, tool_calls=[whole_call(self.name, text)])

    def feed(self, delta_text: str) -> StreamPiece:
        if not self.num_calls:
            return StreamPiece(tool_calls=[self._start_call(self.name, delta_text)])
        return StreamPiece(tool_calls=[self._arguments(delta_text)] if delta_text else [])


class RequiredToolsParser(ToolCallParser):
    """tool_choice "required": the output is a JSON array of calls."""

    def __init__(self) -> None:
        super().__init__()
        self._text = ""
        self._pos = 0            # where the next call's head is looked for
        self._args_start = -1    # the current call's parameters start (-1: between calls)
        self._args_sent = 0

    def extract(self, text: str) -> ExtractedToolCalls:
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:
            return ExtractedToolCalls(content=text)  # cut short (max_tokens): no complete call list
        return ExtractedToolCalls(content=None, tool_calls=[whole_call(c["name"], c["parameters"]) for c in calls])

    def feed(self, delta_text: str) -> StreamPiece:
        self._text += delta_text
        piece = StreamPiece()
        while True:
            if self._args_start < 0:
                head = _CALL_HEAD.match(self._text, self._pos)
                if head is None:
                    break
                piece.tool_calls.append(self._start_call(json.loads(head.group(1))))
                self._args_start = self._args_sent = head.end()
            end = json_value_end(self._text, self._args_start)
            upto = len(self._text) if end is None else end
            if upto > self._args_sent:
                piece.tool_calls.append(self._arguments(self._text[self._args_sent:upto]))
                self._args_sent = upto
            if end is None:
                break
            self._pos, self._args_start = end, -1
        return piece
