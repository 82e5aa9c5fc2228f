"""Structured outputs and tool calling through the real mesh (`myvllm serve`: worker,
scheduler, gateway) with the official `openai` client and the real model."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field
from support.mesh import Mesh

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"timezone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["timezone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def mesh(smollm2_dir: str) -> Iterator[Mesh]:
    # Async scheduling (off by default on CPU): constrained steps take the deferred-bitmask path
    # over gRPC (the worker waits for the bitmask message that follows the step).
    m = Mesh(["--model", smollm2_dir, "--max-model-len", "1024", "--kv-cache-memory", str(64 << 20),
              "--async-scheduling", "--tool-call-parser", "hermes", "--enable-auto-tool-choice"])
    yield m
    assert m.stop() == 0


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> OpenAI:
    return OpenAI(base_url=f"{mesh.base_url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: OpenAI) -> str:
    return client.models.list().data[0].id


def test_parse_with_a_pydantic_model(client: OpenAI, model: str) -> None:
    for temperature in (0.0, 1.0):
        completion = client.chat.completions.parse(
            model=model, messages=[{"role": "user", "content": "Invent a person."}], response_format=Person,
            temperature=temperature, seed=3, max_tokens=100)
        person = completion.choices[0].message.parsed
        assert isinstance(person, Person) and completion.choices[0].finish_reason == "stop"


def test_response_format_json_object_on_completions(client: OpenAI, model: str) -> None:
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"]}
    completion = client.completions.create(
        model=model, prompt="A colour as JSON:", max_tokens=40, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema,
                                                                              "strict": True}}})
    jsonschema.validate(json.loads(completion.choices[0].text), schema)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_structured_outputs_field(client: OpenAI, model: str, endpoint: str) -> None:
    cases = [({"regex": r"[0-9]{3}-[A-Z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[A-Z]{2}", t)),
             ({"choice": ["yes", "no", "perhaps"]}, lambda t: t in ("yes", "no", "perhaps")),
             ({"grammar": 'root ::= "x=" [0-9] [0-9]?'}, lambda t: re.fullmatch(r"x=[0-9][0-9]?", t))]
    for spec, holds in cases:
        body = {"structured_outputs": spec}
        if endpoint == "chat":
            response = client.chat.completions.create(model=model, messages=ASK, max_tokens=20, temperature=0.8,
                                                      seed=1, extra_body=body)
            text = response.choices[0].message.content
        else:
            response = client.completions.create(model=model, prompt="Answer:", max_tokens=20, temperature=0.8,
                                                 seed=1, extra_body=body)
            text = response.choices[0].text
        assert holds(text), (spec, text)
        assert response.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format", "Unsupported type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "parenthesis"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs.grammar", "not defined"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", "not supported"),
    ({"structured_outputs": {"json": {"type": "object"}}, "response_format": {"type": "json_object"}},
     "structured_outputs", "cannot both"),
])
def test_invalid_constraints_are_400(mesh: Mesh, model: str, body: dict, param: str, needle: str) -> None:
    for path, base in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "x"})):
        response = httpx.post(f"{mesh.base_url}{path}", json={"model": model, **base, **body}, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and needle in error["message"], error


def _check_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_tool_choice_required(client: OpenAI, model: str) -> None:
    for temperature in (0.0, 1.0):
        response = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                                  temperature=temperature, seed=5, max_tokens=200)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert all(c.id.startswith("chatcmpl-tool-") for c in choice.message.tool_calls)
        _check_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls])


def _stream_calls(client: OpenAI, **kwargs) -> tuple[list[tuple[str, str]], str | None, int]:
    calls: dict[int, list[str]] = {}
    finish, fragments = None, 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for call in chunk.choices[0].delta.tool_calls or []:
            fragments += 1
            if call.id is not None:
                calls[call.index] = [call.function.name, ""]
            calls[call.index][1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [(n, a) for n, a in (calls[i] for i in sorted(calls))], finish, fragments


def test_tool_choice_required_streamed(client: OpenAI, model: str) -> None:
    calls, finish, fragments = _stream_calls(client, model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                             temperature=0, max_tokens=200)
    assert finish == "tool_calls" and fragments > len(calls)  # arguments arrive in pieces
    _check_calls(calls)


def test_named_tool_choice(client: OpenAI, model: str) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    response = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=named,
                                              temperature=0, max_tokens=100)
    calls = response.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    _check_calls([(c.function.name, c.function.arguments) for c in calls])
    calls, finish, _ = _stream_calls(client, model=model, messages=ASK, tools=TOOLS, tool_choice=named,
                                     temperature=0, max_tokens=100)
    assert finish == "stop" and [n for n, _ in calls] == ["get_time"]
    _check_calls(calls)


def test_grammar_metrics(mesh: Mesh, client: OpenAI, model: str) -> None:
    for _ in range(2):
        client.chat.completions.create(model=model, messages=ASK, max_tokens=10,
                                       extra_body={"structured_outputs": {"choice": ["metric-a", "metric-b"]}})
    values = mesh.metrics()
    assert values["myvllm:grammar_compiles_total"] >= 1
    assert values["myvllm:grammar_cache_hits_total"] >= 1
    assert values["myvllm:grammar_compile_seconds_total"] > 0
