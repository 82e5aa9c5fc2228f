"""Tool-call parsers: `--tool-call-parser NAME` picks the one for tool_choice "auto"."""

from __future__ import annotations

from services.gateway.tool_parsers.base import ExtractedToolCalls, StreamPiece, ToolCallParser
from services.gateway.tool_parsers.hermes import HermesToolParser

TOOL_PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesToolParser}

__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "StreamPiece", "ToolCallParser"]
