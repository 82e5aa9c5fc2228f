"""Structured outputs: the constraint a request puts on its output, and its grammar.

`StructuredOutputsParams` is vLLM's user-facing class (json, regex, choice, grammar,
json_object). It travels to the scheduler as the proto `StructuredOutputs`; the scheduler
compiles it with xgrammar against the tokenizer (services/engine/structured_output.py).

`build_grammar` is the one place a constraint becomes an xgrammar `Grammar`: the gateway
and the offline `LLM` call it to reject an invalid schema or grammar with a clear message
before anything is queued, the scheduler calls it again (its gRPC port is public) and
compiles the result. Parsing needs no tokenizer and is cheap; compiling is what is cached.

JSON is generated compactly (no free whitespace between tokens): a small model given free
whitespace can emit newlines until max_tokens and never close the object.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from services.common.param_errors import SamplingParamsError
from services.common.proto import myvllm_pb2 as pb

# A schema or grammar text larger than this is refused (it is compiled on the scheduler).
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024
# Deepest nesting of objects / arrays in a JSON schema: xgrammar's conversion time grows much
# faster than the depth (400 levels: seconds), and no real schema comes near this.
MAX_SCHEMA_DEPTH = 128

# xgrammar prefixes its messages with "[time] /path/file.cc:line: "; clients need only the rest.
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


class StructuredOutputsError(SamplingParamsError):
    """An invalid constraint (bad schema, regex or grammar): a 400 naming the field."""

    def __init__(self, message: str, param: str = "structured_outputs") -> None:
        super().__init__(param, message)


def json_depth(value: Any) -> int:
    """How deeply objects and arrays nest in `value` (iteratively: any depth is safe)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _check_schema_depth(schema: Any, param: str) -> None:
    if json_depth(schema) > MAX_SCHEMA_DEPTH:
        raise StructuredOutputsError(f"{param} nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels deep",
                                     param)


def _xgrammar_message(error: Exception) -> str:
    text = str(error).strip()
    return _XGRAMMAR_PREFIX.sub("", text).strip() or type(error).__name__


@dataclass
class StructuredOutputsParams:
    """Exactly one of the fields constrains the output (vLLM's names)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    _proto: pb.StructuredOutputs | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise StructuredOutputsError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                f"got {', '.join(given) if given else 'none'}")

    def to_proto(self) -> pb.StructuredOutputs:
        """The proto form (a dict schema becomes JSON text); validated with `build_grammar` once."""
        if self._proto is not None:
            return self._proto
        if self.json is not None:
            if not isinstance(self.json, str):
                _check_schema_depth(self.json, "structured_outputs.json")  # before json.dumps recurses
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            spec = pb.StructuredOutputs(json=text)
        elif self.regex is not None:
            spec = pb.StructuredOutputs(regex=self.regex)
        elif self.choice is not None:
            if not isinstance(self.choice, list) or not all(isinstance(c, str) for c in self.choice):
                raise StructuredOutputsError("structured_outputs.choice must be a list of strings")
            spec = pb.StructuredOutputs(choice=pb.StringList(values=self.choice))
        elif self.grammar is not None:
            spec = pb.StructuredOutputs(grammar=self.grammar)
        else:
            spec = pb.StructuredOutputs(json_object=True)
        build_grammar(spec)
        self._proto = spec
        return spec


def spec_key(spec: pb.StructuredOutputs) -> tuple[str, str]:
    """What identifies a compiled grammar in the cache: the kind and its text."""
    kind = spec.WhichOneof("kind")
    if kind == "choice":
        return kind, json.dumps(list(spec.choice.values))
    return kind or "", str(getattr(spec, kind)) if kind else ""


def _choice_ebnf(choices: list[str]) -> str:
    # JSON string escapes are EBNF string-literal escapes in xgrammar.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(spec: pb.StructuredOutputs):
    """The xgrammar `Grammar` for `spec`; raises `StructuredOutputsError` saying what is wrong."""
    import xgrammar as xgr  # imported here: only constrained requests need it

    kind = spec.WhichOneof("kind")
    if kind is None:
        raise StructuredOutputsError("structured_outputs: no constraint given")
    param = f"structured_outputs.{kind}"
    text = spec_key(spec)[1]
    if len(text) > MAX_SPEC_CHARS:
        raise StructuredOutputsError(f"{param} has {len(text)} characters, at most {MAX_SPEC_CHARS}", param)
    try:
        if kind == "json":
            try:
                schema = json.loads(spec.json)
            except json.JSONDecodeError as e:
                raise StructuredOutputsError(f"{param} is not valid JSON: {e}", param) from None
            if not isinstance(schema, dict):
                raise StructuredOutputsError(f"{param} must be a JSON schema object", param)
            _check_schema_depth(schema, param)
            return xgr.Grammar.from_json_schema(spec.json, any_whitespace=False, strict_mode=True)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            choices = list(spec.choice.values)
            if not choices or len(choices) > MAX_CHOICES or any(c == "" for c in choices):
                raise StructuredOutputsError(f"{param} needs 1 to {MAX_CHOICES} non-empty strings", param)
            return xgr.Grammar.from_ebnf(_choice_ebnf(choices))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.grammar)
        # json_object (OpenAI's response_format {"type": "json_object"}): an object, as vLLM
        # compiles it, not xgrammar's builtin JSON grammar, which also takes a bare array.
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=True, strict_mode=False)
    except StructuredOutputsError:
        raise
    except Exception as e:  # xgrammar reports a bad schema / regex / grammar as RuntimeError
        raise StructuredOutputsError(f"invalid {param}: {_xgrammar_message(e)}", param) from None
