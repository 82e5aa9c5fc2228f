"""OpenAI's Responses API (`POST /v1/responses`), driven by the official `openai` client against
a real uvicorn gateway in front of the fake scheduler. The gateway runs a chat template of our own
that shows the roles, contents, tools and tool calls, so each test reads the exact prompt the
request became; the fake's script is set per test (plain text, a Hermes tool call, JSON)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from support.fake_scheduler import FakeScheduler, FakeSchedulerServer

from services.gateway.migration import MigrationPolicy
from services.gateway.options import GatewayOptions
from services.gateway.protocol import ChatMessage
from services.gateway.server import BackgroundGateway
from services.gateway.serving_responses import Conversation, ResponseStore
from services.gateway.tools import ToolSettings
from services.text.tokenizer import Tokenizer

MODEL = "SmolLM2-135M-Instruct"
REPLY = "Hello there! How are you today?"
TOOL_REPLY = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PERSON = '{"name": "Ada", "age": 36}'
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
                "parameters": WEATHER_PARAMETERS, "strict": True}
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                 "required": ["name", "age"], "additionalProperties": False}
TEMPLATE = (
    "{% if tools %}TOOLS: {{ tools | map(attribute='function') | map(attribute='name') | join(',') }} | {% endif %}"
    "{% for m in messages %}{{ m.role }}{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} {{ c.function.arguments.city }}]"
    "{% endfor %} | {% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


class Person(BaseModel):
    name: str
    age: int


@dataclass
class Stack:
    fake: FakeScheduler
    scheduler_address: str
    gateway: BackgroundGateway
    tokenizer: Tokenizer
    eos: int

    def reply(self, text: str) -> None:
        """The fake's next replies: `text`, then EOS."""
        self.fake.script = self.tokenizer.encode(text, add_special_tokens=False) + [self.eos]

    def token_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def last_prompt(self) -> str:
        return self.tokenizer.decode(list(self.fake.requests[-1].prompt_token_ids))


@pytest.fixture(scope="module")
def stack(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tokenizer = Tokenizer.load(smollm2_dir)
    eos = tokenizer.hf_tokenizer.eos_token_id
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    options = GatewayOptions(tools=ToolSettings("hermes", enable_auto_tool_choice=True), chat_template=str(template))
    fake = FakeScheduler(eos_token_id=eos, max_model_len=1024)
    with FakeSchedulerServer(fake) as scheduler, \
            BackgroundGateway(scheduler.address, smollm2_dir, options=options) as gateway:
        yield Stack(fake, scheduler.address, gateway, tokenizer, eos)


@pytest.fixture(autouse=True)
def fresh_fake(stack: Stack) -> None:
    stack.reply(REPLY)
    stack.fake.fail_after_tokens = 0
    stack.fake.requests.clear()


@pytest.fixture
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway.url}/v1", api_key="x", max_retries=0, timeout=30)


# ---------------------------------------------------------------------- text


def test_text_input(stack: Stack, client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Say hello", metadata={"k": "v"})
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.status == "completed" and response.incomplete_details is None
    assert response.output_text == REPLY
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_") and [c.type for c in message.content] == ["output_text"]
    assert stack.last_prompt() == "user: Say hello | assistant:"
    usage = response.usage
    assert usage.input_tokens == len(stack.fake.requests[-1].prompt_token_ids)
    assert usage.output_tokens == len(stack.token_ids(REPLY)) + 1  # EOS counts
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert response.metadata == {"k": "v"} and response.tool_choice == "auto" and response.tools == []
    assert response.created_at > 0 and response.store is True


def test_instructions_and_message_list(stack: Stack, client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, instructions="Be brief.", temperature=0.5, top_p=0.9, max_output_tokens=50,
        input=[{"role": "developer", "content": "Speak French."},
               {"role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                            {"type": "input_text", "text": "there"}]},
               # an earlier output message, sent back as it came
               {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                "content": [{"type": "output_text", "text": "Bonjour", "annotations": []}]},
               {"type": "message", "role": "user", "content": "Again"}])
    assert response.output_text == REPLY
    # instructions first; developer is the system role; parts are joined as chat joins them
    assert stack.last_prompt() == ("system: Be brief. | system: Speak French. | user: Hi\nthere | "
                                   "assistant: Bonjour | user: Again | assistant:")
    sampling = stack.fake.requests[-1].sampling
    assert sampling.max_tokens == 50
    assert sampling.temperature == pytest.approx(0.5) and sampling.top_p == pytest.approx(0.9)
    assert response.temperature == 0.5 and response.max_output_tokens == 50 and response.instructions == "Be brief."


def test_max_output_tokens_makes_it_incomplete(stack: Stack, client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Say hello", max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"
    assert response.output_text == stack.tokenizer.decode(stack.token_ids(REPLY)[:3])
    assert response.usage.output_tokens == 3
    with client.responses.stream(model=MODEL, input="Say hello", max_output_tokens=3) as stream:
        final = stream.get_final_response()
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == response.output_text


# ---------------------------------------------------------------------- structured outputs


def test_json_schema_format_constrains_the_output(stack: Stack, client: openai.OpenAI) -> None:
    stack.reply(PERSON)
    response = client.responses.create(model=MODEL, input="Invent a person.", text={"format": {
        "type": "json_schema", "name": "person", "schema": PERSON_SCHEMA, "strict": True}})
    constraint = stack.fake.requests[-1].sampling.structured_outputs
    assert json.loads(constraint.json) == PERSON_SCHEMA
    assert json.loads(response.output_text) == {"name": "Ada", "age": 36}
    assert response.text.format.type == "json_schema" and response.text.format.name == "person"
    # the client's own helper: a pydantic model as text_format, parsed back
    parsed = client.responses.parse(model=MODEL, input="Invent a person.", text_format=Person)
    assert parsed.output_parsed == Person(name="Ada", age=36)
    assert json.loads(stack.fake.requests[-1].sampling.structured_outputs.json)["required"] == ["name", "age"]


def test_json_object_format(stack: Stack, client: openai.OpenAI) -> None:
    stack.reply(PERSON)
    client.responses.create(model=MODEL, input="JSON please", text={"format": {"type": "json_object"}})
    assert stack.fake.requests[-1].sampling.structured_outputs.json_object


# ---------------------------------------------------------------------- tools


def test_function_call_round_trip(stack: Stack, client: openai.OpenAI) -> None:
    stack.reply(TOOL_REPLY)
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER_TOOL],
                                    instructions="Use tools.")
    assert stack.last_prompt() == "TOOLS: get_weather | system: Use tools. | user: Weather in Paris? | assistant:"
    message, call = first.output
    assert message.type == "message" and message.content[0].text == "Let me check."
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert first.status == "completed"

    stack.reply(REPLY)
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER_TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"}])
    assert second.output_text == REPLY and second.previous_response_id == first.id
    # the earlier turn (its instructions not carried over), the call, then its result
    assert stack.last_prompt() == (
        f"TOOLS: get_weather | user: Weather in Paris? | assistant: Let me check.[call {call.call_id} get_weather "
        f"Paris] | tool({call.call_id}): 18 degrees, sunny | assistant:")

    # a third turn continues from the second
    client.responses.create(model=MODEL, previous_response_id=second.id, input="Thanks")
    assert stack.last_prompt().endswith(f"tool({call.call_id}): 18 degrees, sunny | assistant: {REPLY} | "
                                        "user: Thanks | assistant:")


def test_function_calls_sent_back_as_input_items(stack: Stack, client: openai.OpenAI) -> None:
    """The same round trip without the store: the call items go back in `input` (store=false)."""
    stack.reply(TOOL_REPLY)
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER_TOOL], store=False)
    stack.reply(REPLY)
    call = first.output[1]
    client.responses.create(model=MODEL, tools=[WEATHER_TOOL], input=[
        {"role": "user", "content": "Weather in Paris?"}, *[item.model_dump() for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"}])
    assert stack.last_prompt() == (
        f"TOOLS: get_weather | user: Weather in Paris? | assistant: Let me check.[call {call.call_id} get_weather "
        f"Paris] | tool({call.call_id}): 18 degrees | assistant:")
    with pytest.raises(openai.NotFoundError):  # store=false: nothing to continue from
        client.responses.create(model=MODEL, previous_response_id=first.id, input="Hi")


def test_named_tool_choice_constrains_to_the_arguments(stack: Stack, client: openai.OpenAI) -> None:
    stack.reply('{"city": "Oslo"}')
    response = client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER_TOOL],
                                       tool_choice={"type": "function", "name": "get_weather"})
    assert json.loads(stack.fake.requests[-1].sampling.structured_outputs.json) == WEATHER_PARAMETERS
    [call] = response.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Oslo"}
    assert response.tool_choice.type == "function" and response.tool_choice.name == "get_weather"


def test_tool_choice_none_hides_the_tools(stack: Stack, client: openai.OpenAI) -> None:
    stack.reply(TOOL_REPLY)
    response = client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER_TOOL], tool_choice="none")
    assert [item.type for item in response.output] == ["message"] and "<tool_call>" in response.output_text
    assert not stack.last_prompt().startswith("TOOLS:")


# ---------------------------------------------------------------------- streaming


def test_stream_text(stack: Stack, client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input="Say hello") as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == REPLY
    assert events[-4].text == REPLY and events[-2].item.status == "completed"
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.id == events[0].response.id and final.status == "completed" and final.output_text == REPLY
    assert final.usage.output_tokens == len(stack.token_ids(REPLY)) + 1
    # a streamed response is stored like any other
    client.responses.create(model=MODEL, previous_response_id=final.id, input="And you?")
    assert stack.last_prompt() == f"user: Say hello | assistant: {REPLY} | user: And you? | assistant:"


def test_stream_function_call(stack: Stack, client: openai.OpenAI) -> None:
    stack.reply(TOOL_REPLY)
    events = list(client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER_TOOL], stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    call_added = types.index("response.output_item.added", types.index("response.output_item.done"))
    assert events[call_added].item.type == "function_call" and events[call_added].item.name == "get_weather"
    assert types[call_added + 1:] == ["response.function_call_arguments.delta"] * (len(types) - call_added - 4) + [
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(arguments) == {"city": "Paris"} and events[-3].arguments == arguments
    final = events[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output[1].call_id == events[call_added].item.call_id and final.output[1].arguments == arguments
    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=[WEATHER_TOOL]) as stream:
        parsed = stream.get_final_response()
    assert parsed.output[1].parsed_arguments == {"city": "Paris"}  # a strict tool: the client parses them


def test_a_stored_response_is_retrieved_and_deleted(stack: Stack, client: openai.OpenAI) -> None:
    created = client.responses.create(model=MODEL, input="Say hello", metadata={"k": "v"})
    got = client.responses.retrieve(created.id)
    assert got.model_dump() == created.model_dump()  # the very object create returned
    streamed = list(client.responses.create(model=MODEL, input="Again", stream=True))
    completed = streamed[-1].response
    assert client.responses.retrieve(completed.id).output_text == completed.output_text == REPLY
    unstored = client.responses.create(model=MODEL, input="Say hello", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.retrieve(created.id, stream=True)
    assert caught.value.body["param"] == "stream"
    assert client.responses.delete(created.id) is None
    for gone in (lambda: client.responses.retrieve(created.id), lambda: client.responses.delete(created.id),
                 lambda: client.responses.create(model=MODEL, previous_response_id=created.id, input="Hi")):
        with pytest.raises(openai.NotFoundError, match=created.id):
            gone()
    # The others are still there, as a previous response too.
    follow_up = client.responses.create(model=MODEL, previous_response_id=completed.id, input="More")
    assert stack.last_prompt() == f"user: Again | assistant: {REPLY} | user: More | assistant:"
    assert client.responses.retrieve(follow_up.id).previous_response_id == completed.id


# ---------------------------------------------------------------------- errors


def test_unknown_previous_response_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="resp_nope") as caught:
        client.responses.create(model=MODEL, previous_response_id="resp_nope", input="Hi")
    assert caught.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize(("body", "param"), [
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}, "color": "red"}]}, "tools[0].color"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice.type"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "output": "18"}]}, "input[0].call_id"),
    ({"input": []}, "input"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objec"}}}}, "text.format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"temperature": -1}, "temperature"),
])
def test_bad_requests_are_400_naming_the_field(client: openai.OpenAI, body: dict, param: str) -> None:
    body = {"input": "Hi", **body}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=body.pop("input"), extra_body=body)
    assert caught.value.body["param"] == param, caught.value.body


def test_a_failure_mid_stream_is_an_error_event(stack: Stack, smollm2_dir: str) -> None:
    """Once the stream has begun, a failure is reported in-band (an `error` event), as OpenAI does."""
    stack.fake.fail_after_tokens = 3
    options = GatewayOptions(migration=MigrationPolicy(max_migrations=0))
    with BackgroundGateway(stack.scheduler_address, smollm2_dir, options=options) as gateway:
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0, timeout=30)
        events = list(client.responses.create(model=MODEL, input="Say hello", stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.output_text.delta" in [e.type for e in events]
    assert events[-1].type == "error" and events[-1].code == "engine_fault"
    assert events[-1].message == "The engine failed the request"  # ours: the engine's account is logged


def test_unrecognized_field_is_named(stack: Stack) -> None:
    reply = httpx.post(f"{stack.gateway.url}/v1/responses", json={"input": "Hi", "frobnicate": 1})
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == "Unrecognized request argument supplied: frobnicate"


# ---------------------------------------------------------------------- the store


def test_store_is_bounded_lru() -> None:
    def conversation(text: str) -> Conversation:
        return Conversation().extended([ChatMessage(role="user", content=text)])

    store = ResponseStore(max_responses=2, max_chars=10)
    store.put("a", conversation("aaa"))
    store.put("b", conversation("bbb"))
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", conversation("ccc"))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    store.put("d", conversation("dddddddd"))  # 3 + 8 > 10 characters: only d stays
    assert [key for key in "abcd" if store.get(key) is not None] == ["d"]
    store.put("e", conversation("e" * 11))  # larger than the whole store: not kept
    assert store.get("e") is None and store.get("d") is not None
    assert store.delete("d") and not store.delete("d") and len(store) == 0
    store.put("f", conversation("f" * 10))  # deleting gave its characters back
    assert store.get("f") is not None


# ---------------------------------------------------------------------- fuzzing

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=8)
content = st.text(max_size=20) | st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "input_image"]), "text": st.text(max_size=10)}),
    max_size=2)
items = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]),
                           "content": content}, optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.text(max_size=5),
                           "name": st.text(max_size=5), "arguments": st.text(max_size=12)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.text(max_size=5),
                           "output": content}),
    json_values), max_size=3)
tools = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]),
                                        "name": st.text(max_size=6)},
                                       optional={"parameters": json_values, "strict": st.booleans()}), max_size=2)
FIELDS = {
    "input": st.text(max_size=20) | items, "instructions": st.text(max_size=10),
    "max_output_tokens": st.integers(-2, 40),
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "tools": tools,
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "name": ""}]),
    "text": st.fixed_dictionaries({"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])}, optional={"schema": json_values})}),
    "previous_response_id": st.text(max_size=6), "store": st.booleans(), "stream": st.booleans(),
}
# A valid request with any of the fields plausible or wild.
bodies = st.builds(lambda extra: {"model": MODEL, "input": "Hi", "max_output_tokens": 4, **extra},
                   st.fixed_dictionaries({}, optional={name: values | json_values for name, values in FIELDS.items()}))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=bodies)
def test_no_body_is_a_5xx(stack: Stack, body: dict) -> None:
    response = httpx.post(f"{stack.gateway.url}/v1/responses", content=json.dumps(body),
                          headers={"content-type": "application/json"}, timeout=10)
    event(f"HTTP {response.status_code}")
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    else:
        assert '"type":"error"' not in response.text, response.text  # nor an in-band one in a stream
