"""Tool-call parsers on scripted model outputs: whole and streamed (in every chunking) give the
same calls; the Hermes parser through a real gateway (a scripted scheduler plays the model)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest
from support.fake_scheduler import FakeScheduler, FakeSchedulerServer

from services.common.structured_outputs import StructuredOutputsParams
from services.gateway.options import GatewayOptions
from services.gateway.protocol import ChatCompletionToolParam
from services.gateway.server import BackgroundGateway
from services.gateway.tool_parsers import ToolCallParser
from services.gateway.tool_parsers.base import json_value_end
from services.gateway.tool_parsers.constrained import NamedFunctionParser, RequiredToolsParser
from services.gateway.tool_parsers.hermes import HermesToolParser
from services.gateway.tools import ToolSettings, required_schema
from services.text.tokenizer import Tokenizer

HERMES_OUTPUT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
                 '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
REQUIRED_OUTPUT = ('[{"name": "get_weather", "parameters": {"city": "Par\\"is}", "days": [1, 2]}}, '
                   '{"name": "get_time", "parameters": {"tz": "CET"}}]')
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}


FRAGMENTS: list[int] = []  # argument fragments of the last `_streamed` run


def _streamed(parser: ToolCallParser, text: str, size: int) -> tuple[str, list[tuple[str, str]]]:
    """Feed `text` in chunks of `size`; (content, [(name, arguments)]) assembled from the deltas."""
    content, calls = "", {}
    FRAGMENTS.clear()
    pieces = [parser.feed(text[i:i + size]) for i in range(0, len(text), size)] + [parser.finish()]
    for piece in pieces:
        content += piece.content
        for delta in piece.tool_calls:
            if delta.id is not None:
                assert delta.index not in calls and delta.type == "function"
                calls[delta.index] = [delta.function.name, ""]
            calls[delta.index][1] += delta.function.arguments or ""
            FRAGMENTS.append(delta.index)
    return content, [tuple(calls[i]) for i in sorted(calls)]


def test_hermes_whole_output() -> None:
    extracted = HermesToolParser().extract(HERMES_OUTPUT)
    assert extracted.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in extracted.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"tz": "CET"})]
    assert len({c.id for c in extracted.tool_calls}) == 2


def test_hermes_without_calls_or_with_broken_json_is_content() -> None:
    assert HermesToolParser().extract("just text").content == "just text"
    broken = "<tool_call>{not json</tool_call>"
    extracted = HermesToolParser().extract(broken)
    assert extracted.content == broken and not extracted.tool_calls


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_hermes_streamed_equals_whole(size: int) -> None:
    content, calls = _streamed(HermesToolParser(), HERMES_OUTPUT, size)
    assert content == "Let me check.\n"
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris", "unit": "C"}),
                                                      ("get_time", {"tz": "CET"})]
    if size < 5:  # the arguments arrive in pieces as they are written
        assert FRAGMENTS.count(0) > 3


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_hermes_streams_other_shapes_whole(size: int) -> None:
    text = ('<tool_call>{"arguments": {"tz": "UTC"}, "name": "get_time"}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "a\\"}</tool_call>\"}}</tool_call>')
    # Arguments first: sent whole at its closing tag; name first: streamed, a closing tag inside a
    # JSON string included.
    content, calls = _streamed(HermesToolParser(), text, size)
    assert content == "" and [(n, json.loads(a)) for n, a in calls] == [
        ("get_time", {"tz": "UTC"}), ("get_weather", {"city": 'a"}</tool_call>'})]


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_hermes_streams_plain_text_untouched(size: int) -> None:
    text = "a < b and <tool is not a tag"
    assert _streamed(HermesToolParser(), text, size) == (text, [])


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_required_streamed_equals_whole(size: int) -> None:
    whole = RequiredToolsParser().extract(REQUIRED_OUTPUT)
    expected = [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls]
    assert expected == [("get_weather", {"city": 'Par"is}', "days": [1, 2]}), ("get_time", {"tz": "CET"})]
    content, calls = _streamed(RequiredToolsParser(), REQUIRED_OUTPUT, size)
    assert content == "" and [(n, json.loads(a)) for n, a in calls] == expected


def test_named_function_streams_arguments() -> None:
    content, calls = _streamed(NamedFunctionParser("get_weather"), '{"city": "Oslo"}', 4)
    assert content == "" and calls == [("get_weather", '{"city": "Oslo"}')]


def test_json_value_end() -> None:
    assert json_value_end('{"a": "}"} tail', 0) == 10
    assert json_value_end('{"a": [1, {', 0) is None


def test_chat_template_flag_is_checked_at_start_up(tmp_path) -> None:
    with pytest.raises(ValueError, match="neither a file nor a template"):
        GatewayOptions(chat_template=str(tmp_path / "missing.jinja"))
    assert GatewayOptions(chat_template="{{ messages[0].content }}").chat_template


def test_tool_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ToolSettings(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="must be one of"):
        ToolSettings(tool_call_parser="nope")


# ---------------------------------------------------------------------- through a gateway


# A chat template of our own (--chat-template FILE) that shows the tools, tool calls and tool results.
TEMPLATE = (
    "{% if tools %}TOOLS: {{ tools | map(attribute='function') | map(attribute='name') | join(',') }} | {% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %}"
    " | {% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


@dataclass
class Gateway:
    client: openai.OpenAI
    fake: FakeScheduler
    tokenizer: Tokenizer

    def last_prompt(self) -> str:
        return self.tokenizer.decode(list(self.fake.requests[-1].prompt_token_ids))


@pytest.fixture(scope="module")
def gateway(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tokenizer = Tokenizer.load(smollm2_dir)
    eos = tokenizer.hf_tokenizer.eos_token_id
    script = tokenizer.encode(HERMES_OUTPUT, add_special_tokens=False) + [eos]
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    options = GatewayOptions(tools=ToolSettings("hermes", enable_auto_tool_choice=True), chat_template=str(template))
    fake = FakeScheduler(script=script, eos_token_id=eos)
    with FakeSchedulerServer(fake) as scheduler, \
            BackgroundGateway(scheduler.address, smollm2_dir, options=options) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=30)
        yield Gateway(client, fake, tokenizer)


@pytest.fixture
def client(gateway: Gateway) -> openai.OpenAI:
    return gateway.client


def test_auto_hermes_tool_calls(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model="SmolLM2-135M-Instruct", tools=[WEATHER_TOOL],
                                              messages=[{"role": "user", "content": "Weather in Paris?"}])
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"tz": "CET"})]
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in choice.message.tool_calls)


def test_auto_hermes_tool_calls_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", tools=[WEATHER_TOOL], stream=True,
                                            tool_choice="auto",
                                            messages=[{"role": "user", "content": "Weather in Paris?"}])
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content.strip() == "Let me check." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"tz": "CET"})]


def test_tool_choice_none_is_plain_chat(gateway: Gateway, client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model="SmolLM2-135M-Instruct", tools=[WEATHER_TOOL], tool_choice="none",
                                              messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert response.choices[0].message.tool_calls in (None, [])
    assert "<tool_call>" in response.choices[0].message.content
    assert not gateway.last_prompt().startswith("TOOLS:")  # the tools are not offered to the model


def test_tool_messages_go_through_the_template(gateway: Gateway, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    response = client.chat.completions.create(model="SmolLM2-135M-Instruct", tools=[WEATHER_TOOL], messages=messages)
    assert response.choices[0].message.tool_calls
    # --chat-template's template rendered the tools, the call (arguments as an object) and the result.
    assert gateway.last_prompt() == ("TOOLS: get_weather | user: Weather in Paris? | "
                                     "assistant: [call get_weather Paris] | tool: 18 degrees, sunny | assistant:")


def test_tool_errors_are_400(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, tools=[WEATHER_TOOL],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, tool_choice="required")
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}
    with pytest.raises(openai.BadRequestError, match="not a usable JSON schema"):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, tools=[bad_tool],
                                       tool_choice="required")



def test_required_schema_hoists_defs() -> None:
    tool = ChatCompletionToolParam.model_validate({"type": "function", "function": {"name": "add", "parameters": {
        "$defs": {"num": {"type": "integer", "minimum": 0, "maximum": 9}}, "type": "object",
        "properties": {"a": {"$ref": "#/$defs/num"}, "b": {"$ref": "#/$defs/num"}}, "required": ["a", "b"]}}})
    weather = ChatCompletionToolParam.model_validate(WEATHER_TOOL)
    schema = required_schema([tool, weather], parallel=False)
    assert schema["$defs"] == {"num": {"type": "integer", "minimum": 0, "maximum": 9}} and schema["maxItems"] == 1
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    StructuredOutputsParams(json=schema).to_proto()  # the references resolve at the top
