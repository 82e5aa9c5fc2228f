"""A request's output constraint from the HTTP fields: OpenAI's `response_format`, vLLM's
`structured_outputs` or its older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` (at most one of those three ways; tool calling adds its own, see tools.py).

Each is checked here (shape) and parsed into an xgrammar grammar by `StructuredOutputsParams`
(content), so an invalid schema, regex or grammar is a 400 naming the field before the
request reaches an engine.
"""

from __future__ import annotations

from typing import Any

from services.common.structured_outputs import StructuredOutputsError, StructuredOutputsParams
from services.gateway.errors import invalid_request
from services.gateway.protocol import GenerationRequest
from services.gateway.protocol_vllm import GUIDED_FIELDS

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _from_response_format(response_format: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise invalid_request(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                              param="response_format.type")
    json_schema = response_format.get("json_schema")
    if not isinstance(json_schema, dict) or not isinstance(json_schema.get("schema"), dict):
        raise invalid_request("response_format of type 'json_schema' needs json_schema.schema, a JSON schema object",
                              param="response_format.json_schema")
    # strict or not, the output follows the schema (xgrammar's strict mode: no undeclared properties).
    return StructuredOutputsParams(json=json_schema["schema"])


def _from_structured_outputs(fields: dict[str, Any]) -> StructuredOutputsParams:
    unknown = sorted(set(fields) - set(_KINDS))
    if unknown:
        raise invalid_request(f"structured_outputs.{unknown[0]} is not supported (use one of {', '.join(_KINDS)})",
                              param=f"structured_outputs.{unknown[0]}", code="unsupported_parameter")
    json_value = fields.get("json")
    if json_value is not None and not isinstance(json_value, (str, dict)):
        raise invalid_request("structured_outputs.json must be a JSON schema (an object or its JSON text)",
                              param="structured_outputs.json")
    for name in ("regex", "grammar"):
        if fields.get(name) is not None and not isinstance(fields[name], str):
            raise invalid_request(f"structured_outputs.{name} must be a string", param=f"structured_outputs.{name}")
    json_object = fields.get("json_object")
    if json_object is not None and not isinstance(json_object, bool):
        raise invalid_request("structured_outputs.json_object must be a boolean",
                              param="structured_outputs.json_object")
    return StructuredOutputsParams(json=json_value, regex=fields.get("regex"), choice=fields.get("choice"),
                                   grammar=fields.get("grammar"), json_object=json_object)


def _from_guided_fields(request: GenerationRequest) -> StructuredOutputsParams | None:
    """vLLM's guided_* fields as the structured_outputs they stand for; a 400 names the guided field."""
    guided = request.guided_fields()
    if not guided:
        return None
    names = list(guided)
    if len(names) > 1:
        raise invalid_request(f"Only one kind of guided decoding may be given, got {', '.join(names)}",
                              param=names[1])
    name = names[0]
    constrains_format = (request.response_format or {}).get("type", "text") != "text"
    if request.structured_outputs or constrains_format:
        other = "structured_outputs" if request.structured_outputs else "response_format"
        raise invalid_request(f"{name} and {other} cannot both constrain the output", param=name)
    kind = GUIDED_FIELDS[name]
    try:
        params = StructuredOutputsParams(**{kind: guided[name]})
        params.to_proto()  # parses the schema / regex / grammar: a bad one is a 400 now
        return params
    except StructuredOutputsError as e:
        raise invalid_request(str(e).replace(f"structured_outputs.{kind}", name), param=name) from None


def request_structured_outputs(request: GenerationRequest) -> StructuredOutputsParams | None:
    """The constraint `request` asks for (None: free output); a 400 naming the field if it is bad."""
    from_guided = _from_guided_fields(request)
    if from_guided is not None:
        return from_guided
    try:
        from_format = _from_response_format(request.response_format) if request.response_format else None
        from_field = _from_structured_outputs(request.structured_outputs) if request.structured_outputs else None
        if from_format is not None and from_field is not None:
            raise invalid_request("response_format and structured_outputs cannot both constrain the output",
                                  param="structured_outputs")
        params = from_format or from_field
        if params is not None:
            params.to_proto()  # parses the schema / regex / grammar: a bad one is a 400 now
        return params
    except StructuredOutputsError as e:
        param = e.param if request.structured_outputs else "response_format"
        raise invalid_request(str(e), param=param) from None
