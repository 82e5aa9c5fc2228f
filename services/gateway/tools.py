"""Tool calling on chat completions: what `tools` + `tool_choice` ask of the engine and
how the output is read back.

- "none" (or no tools): plain chat; the tools are not shown to the model.
- "required": the output is constrained to a JSON array of calls of the given tools (their
  parameter schemas), so any model answers with valid calls; finish_reason "tool_calls".
- a named function: the output is constrained to that function's parameters; finish_reason
  "stop", as OpenAI's.
- "auto" (the default when tools are given): the model decides; its own format is read by
  the parser chosen with --tool-call-parser (needs --enable-auto-tool-choice, as `vllm serve`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.common.structured_outputs import StructuredOutputsError, StructuredOutputsParams
from services.gateway.errors import invalid_request
from services.gateway.protocol import ChatCompletionRequest, ChatCompletionToolParam
from services.gateway.tool_parsers import TOOL_PARSERS, ToolCallParser
from services.gateway.tool_parsers.constrained import NamedFunctionParser, RequiredToolsParser

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolSettings:
    """The gateway's flags for tool calling."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(sorted(TOOL_PARSERS))}, "
                             f"got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


@dataclass
class ToolPlan:
    """How one chat request uses its tools."""

    tools: list[dict[str, Any]] | None              # shown to the chat template (None: none)
    structured_outputs: StructuredOutputsParams | None
    new_parser: Callable[[], ToolCallParser] | None  # one parser per choice
    finish_reason: str                               # when the output holds tool calls
    skip_special_tokens: bool | None = None          # the parser needs special tokens kept


def _parameters(tool: ChatCompletionToolParam) -> dict[str, Any]:
    return tool.function.parameters or _ANY_OBJECT


def required_schema(tools: list[ChatCompletionToolParam], parallel: bool) -> dict[str, Any]:
    """A JSON array of at least one {"name", "parameters"} call of any of `tools` (at most one
    unless parallel tool calls are allowed). Each tool's `$defs` move to the top, where its
    `#/$defs/...` references point once its parameters are nested in the array."""
    defs: dict[str, Any] = {}
    calls = []
    for tool in tools:
        parameters = dict(_parameters(tool))
        for name, definition in (parameters.pop("$defs", None) or {}).items():
            if defs.setdefault(name, definition) != definition:
                raise invalid_request(f"tools define $defs/{name} differently; rename one", param="tools")
        calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                                        "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _constraint(schema: dict[str, Any]) -> StructuredOutputsParams:
    """The output constraint for tool calls (a tool's bad parameter schema is a 400 on `tools`)."""
    spec = StructuredOutputsParams(json=schema)
    try:
        spec.to_proto()
    except StructuredOutputsError as e:
        raise invalid_request(f"a tool's parameters are not a usable JSON schema: {e}", param="tools") from None
    return spec


def plan_tools(request: ChatCompletionRequest, settings: ToolSettings) -> ToolPlan | None:
    """The request's tool plan (None: no tool calling); a 400 naming the field if it cannot run."""
    tools, choice = request.tools or [], request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise invalid_request(f"tool_choice {choice if isinstance(choice, str) else 'function'!r} needs tools",
                                  param="tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid_request("tools must have distinct function names", param="tools")
    if choice == "none":
        return None
    dumped = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "required":
        spec = _constraint(required_schema(tools, request.parallel_tool_calls is not False))
        return ToolPlan(dumped, spec, RequiredToolsParser, "tool_calls")
    if choice is not None and not isinstance(choice, str):
        matches = [t for t in tools if t.function.name == choice.function.name]
        if not matches:
            raise invalid_request(f"tool_choice names function {choice.function.name!r}, which is not in tools",
                                  param="tool_choice")
        name = choice.function.name
        return ToolPlan(dumped, _constraint(_parameters(matches[0])), lambda: NamedFunctionParser(name), "stop")
    if not settings.enable_auto_tool_choice:
        raise invalid_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                              'set on the server', param="tool_choice")
    return ToolPlan(dumped, None, TOOL_PARSERS[settings.tool_call_parser], "tool_calls", skip_special_tokens=False)
