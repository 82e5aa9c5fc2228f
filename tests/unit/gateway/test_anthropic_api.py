"""The Anthropic Messages API of the gateway (/v1/messages, /v1/messages/count_tokens), driven
by the official `anthropic` client against a real uvicorn server in front of the fake scheduler."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import anthropic
import httpx
import pytest
from support.fake_scheduler import FakeScheduler, FakeSchedulerServer

from services.common.proto import myvllm_pb2 as pb
from services.gateway.options import GatewayOptions
from services.gateway.server import BackgroundGateway
from services.gateway.tools import ToolSettings
from services.text.tokenizer import Tokenizer

MODEL = "SmolLM2-135M-Instruct"
# An output cut by max_tokens inside a character ends without its U+FFFD (the incomplete
# bytes are held back, as vLLM does): the expected text is decode()'s without it.
CUT = "\ufffd"
MAX_MODEL_LEN = 512
EOS = 2  # <|im_end|>
REPLY = "Hello 世界 🎉! How are you today?"
MESSAGES = [{"role": "user", "content": "Say hello"}]
SYSTEM = "You are a terse pirate."


@dataclass
class Stack:
    scheduler: FakeSchedulerServer
    gateway: BackgroundGateway
    tokenizer: Tokenizer
    reply_ids: list[int]

    @property
    def fake(self) -> FakeScheduler:
        return self.scheduler.servicer

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The chat template's rendering of OpenAI-style `messages`, tokenized."""
        return self.tokenizer.encode(self.tokenizer.render_chat(messages), add_special_tokens=False)

    def last_prompt(self) -> str:
        return self.tokenizer.decode(list(self.fake.requests[-1].prompt_token_ids), skip_special_tokens=False)


@pytest.fixture(scope="module")
def stack(smollm2_dir: str) -> Iterator[Stack]:
    tokenizer = Tokenizer.load(smollm2_dir)
    reply_ids = tokenizer.encode(REPLY, add_special_tokens=False)
    fake = FakeScheduler(script=reply_ids + [EOS], eos_token_id=EOS, max_model_len=MAX_MODEL_LEN)
    with FakeSchedulerServer(fake) as scheduler, BackgroundGateway(scheduler.address, smollm2_dir) as gw:
        yield Stack(scheduler, gw, tokenizer, reply_ids)


@pytest.fixture(autouse=True)
def fresh_fake(stack: Stack) -> None:
    stack.fake.requests.clear()
    stack.fake.aborted.clear()


@pytest.fixture
def client(stack: Stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.gateway.url, api_key="x", max_retries=0, timeout=30)


# ---------------------------------------------------------------------- messages


def test_create_message(stack: Stack, client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=MODEL, max_tokens=64, messages=MESSAGES, metadata={"user_id": "u1"})
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    assert [(b.type, b.text) for b in message.content] == [("text", REPLY)]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    prompt_ids = stack.prompt_ids(MESSAGES)
    assert list(stack.fake.requests[0].prompt_token_ids) == prompt_ids  # rendered as the chat route renders
    assert message.usage.input_tokens == len(prompt_ids)
    assert message.usage.output_tokens == len(stack.reply_ids) + 1  # EOS counts, as on the chat route


@pytest.mark.parametrize("system", [SYSTEM, [{"type": "text", "text": SYSTEM}]])
def test_system_prompt_reaches_the_prompt(stack: Stack, client: anthropic.Anthropic, system) -> None:
    client.messages.create(model=MODEL, max_tokens=8, system=system, messages=MESSAGES)
    assert SYSTEM in stack.last_prompt()
    assert list(stack.fake.requests[0].prompt_token_ids) == stack.prompt_ids(
        [{"role": "system", "content": SYSTEM}, *MESSAGES])


def test_content_blocks_and_string_content_render_alike(stack: Stack, client: anthropic.Anthropic) -> None:
    client.messages.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Say hello", "cache_control": {"type": "ephemeral"}}]}])
    assert list(stack.fake.requests[0].prompt_token_ids) == stack.prompt_ids(MESSAGES)


def test_stop_sequences(client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=MODEL, max_tokens=64, messages=MESSAGES, stop_sequences=["nope", "How"])
    assert message.content[0].text == REPLY[:REPLY.index("How")]
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "How"


def test_max_tokens(stack: Stack, client: anthropic.Anthropic) -> None:
    message = client.messages.create(model=MODEL, max_tokens=3, messages=MESSAGES)
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 3
    assert message.content[0].text == stack.tokenizer.decode(stack.reply_ids[:3]).removesuffix(CUT)


def test_sampling_parameters_reach_the_scheduler(stack: Stack, client: anthropic.Anthropic) -> None:
    # This client version no longer has these as arguments; the API (Anthropic's and ours) takes them.
    client.messages.create(model=MODEL, max_tokens=9, messages=MESSAGES,
                           extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 40})
    sampling = stack.fake.requests[0].sampling
    assert sampling.temperature == pytest.approx(0.5) and sampling.top_p == pytest.approx(0.9)
    assert (sampling.top_k, sampling.max_tokens) == (40, 9)


def test_assistant_prefill_is_continued(stack: Stack, client: anthropic.Anthropic) -> None:
    """A final assistant turn is continued (Anthropic's prefill), not closed and answered."""
    client.messages.create(model=MODEL, max_tokens=4, messages=[*MESSAGES, {"role": "assistant", "content": "Ahoy"}])
    assert stack.last_prompt().endswith("<|im_start|>assistant\nAhoy")


# ---------------------------------------------------------------------- streaming


def test_stream(stack: Stack, client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=MODEL, max_tokens=64, messages=MESSAGES) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == REPLY
    assert [(b.type, b.text) for b in final.content] == [("text", REPLY)]
    assert final.stop_reason == "end_turn" and final.id.startswith("msg_")
    assert final.usage.input_tokens == len(stack.prompt_ids(MESSAGES))
    assert final.usage.output_tokens == len(stack.reply_ids) + 1


def test_stream_stop_sequence(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=MODEL, max_tokens=64, messages=MESSAGES, stop_sequences=["How"]) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == REPLY[:REPLY.index("How")]
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "How"


def test_sse_framing_is_anthropics(stack: Stack) -> None:
    body = {"model": MODEL, "max_tokens": 64, "messages": MESSAGES, "stream": True}
    with httpx.stream("POST", f"{stack.gateway.url}/v1/messages", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [frame.split("\n") for frame in raw.split("\n\n") if frame]
    assert all(len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: ")
               for lines in events)
    types = [lines[0].removeprefix("event: ") for lines in events]
    payloads = [json.loads(lines[1].removeprefix("data: ")) for lines in events]
    assert [p["type"] for p in payloads] == types  # each event's data names its own type
    assert types[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[3:-3]) == {"content_block_delta"}
    assert payloads[0]["message"]["content"] == [] and payloads[0]["message"]["usage"]["output_tokens"] == 0
    assert payloads[2] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(p["delta"]["text"] for p in payloads[3:-3]) == REPLY
    assert payloads[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert payloads[-2]["usage"]["output_tokens"] == len(stack.reply_ids) + 1


# ---------------------------------------------------------------------- count_tokens


def test_count_tokens_matches_the_real_prompt(stack: Stack, client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=MESSAGES)
    assert counted.input_tokens == len(stack.prompt_ids([{"role": "system", "content": SYSTEM}, *MESSAGES]))
    message = client.messages.create(model=MODEL, max_tokens=2, system=SYSTEM, messages=MESSAGES)
    assert message.usage.input_tokens == counted.input_tokens
    assert len(stack.fake.requests) == 1  # counting ran nothing on the engine


# ---------------------------------------------------------------------- errors


def _assert_anthropic_error(body: object, error_type: str, match: str) -> None:
    assert isinstance(body, dict) and body["type"] == "error", body
    assert body["error"]["type"] == error_type and match in body["error"]["message"], body


def test_unknown_model_is_not_found(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="no-such-model", max_tokens=8, messages=MESSAGES)
    _assert_anthropic_error(info.value.body, "not_found_error", "no-such-model")


def test_missing_max_tokens_is_a_bad_request(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        client.post("/v1/messages", body={"model": MODEL, "messages": MESSAGES}, cast_to=object)
    _assert_anthropic_error(info.value.body, "invalid_request_error", "max_tokens")


@pytest.mark.parametrize(("extra", "match"), [
    ({"temperature": -1}, "temperature"),
    ({"unknown_field": 1}, "unknown_field"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "role"),
    ({"tool_choice": {"type": "any"}}, "needs tools"),
])
def test_bad_requests_are_anthropic_shaped(client: anthropic.Anthropic, extra: dict, match: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        client.post("/v1/messages", body={"model": MODEL, "max_tokens": 8, "messages": MESSAGES, **extra},
                    cast_to=object)
    _assert_anthropic_error(info.value.body, "invalid_request_error", match)


def test_openai_routes_keep_openai_errors(stack: Stack) -> None:
    response = httpx.post(f"{stack.gateway.url}/v1/chat/completions", json={"model": "nope", "messages": MESSAGES})
    assert response.status_code == 404
    assert set(response.json()) == {"error"} and response.json()["error"]["code"] == "model_not_found"
    response = httpx.post(f"{stack.gateway.url}/v1/messages/count_tokens", json={"messages": MESSAGES})
    assert response.status_code == 400
    _assert_anthropic_error(response.json(), "invalid_request_error", "model")


def test_api_key_as_x_api_key(stack: Stack, smollm2_dir: str) -> None:
    options = GatewayOptions(api_key="sekret")
    with BackgroundGateway(stack.scheduler.address, smollm2_dir, options=options) as gw:
        # Anthropic's own header (the client sends only it here) and the bearer token both work.
        by_header = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=30,
                                        default_headers={"x-api-key": "sekret", "Authorization": anthropic.omit})
        assert by_header.messages.create(model=MODEL, max_tokens=64, messages=MESSAGES).content[0].text == REPLY
        by_bearer = anthropic.Anthropic(base_url=gw.url, api_key="sekret", max_retries=0, timeout=30)
        assert by_bearer.messages.count_tokens(model=MODEL, messages=MESSAGES).input_tokens > 0
        wrong = anthropic.Anthropic(base_url=gw.url, api_key="nope", max_retries=0, timeout=30)
        with pytest.raises(anthropic.AuthenticationError) as info:
            wrong.messages.create(model=MODEL, max_tokens=8, messages=MESSAGES)
        _assert_anthropic_error(info.value.body, "authentication_error", "Incorrect API key")
        response = httpx.post(f"{gw.url}/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": MESSAGES},
                              headers={"x-api-key": "nope"})
        assert response.status_code == 401
        _assert_anthropic_error(response.json(), "authentication_error", "Incorrect API key")
        response = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        response = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                                     "max_tokens": 2}, headers={"x-api-key": "sekret"})
        assert response.status_code == 200


# ---------------------------------------------------------------------- tools

HERMES_OUTPUT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
                 '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
NAMED_ARGUMENTS = '{"city": "Oslo"}'
WEATHER_TOOL = {"name": "get_weather", "description": "Weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}, "required": ["city"]}}
TIME_TOOL = {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}}}
QUESTION = {"role": "user", "content": "Weather in Paris?"}
# A chat template of our own (--chat-template) that shows the tools, the calls (ids, arguments as
# objects) and the results with the call they answer.
TEMPLATE = (
    "{% if tools %}TOOLS: {{ tools | map(attribute='function') | map(attribute='name') | join(',') }} | {% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} {{ c.function.arguments.city }}]"
    "{% endfor %}{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %}"
    " | {% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def tools_stack(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tokenizer = Tokenizer.load(smollm2_dir)
    eos = tokenizer.hf_tokenizer.eos_token_id
    hermes_ids = tokenizer.encode(HERMES_OUTPUT, add_special_tokens=False) + [eos]
    named_ids = tokenizer.encode(NAMED_ARGUMENTS, add_special_tokens=False) + [eos]

    def script(request: pb.GenerateRequest) -> list[int]:
        # A forced tool constrains the output to its arguments: the fake answers with them.
        return named_ids if request.sampling.HasField("structured_outputs") else hermes_ids

    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    options = GatewayOptions(tools=ToolSettings("hermes", enable_auto_tool_choice=True), chat_template=str(template))
    fake = FakeScheduler(script=script, eos_token_id=eos)
    with FakeSchedulerServer(fake) as scheduler, \
            BackgroundGateway(scheduler.address, smollm2_dir, options=options) as gw:
        yield Stack(scheduler, gw, tokenizer, hermes_ids)


@pytest.fixture
def tools_client(tools_stack: Stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tools_stack.gateway.url, api_key="x", max_retries=0, timeout=30)


EXPECTED_CALLS = [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"tz": "CET"})]


def test_tool_use_round_trip(tools_stack: Stack, tools_client: anthropic.Anthropic) -> None:
    message = tools_client.messages.create(model=MODEL, max_tokens=256, tools=[WEATHER_TOOL, TIME_TOOL],
                                           messages=[QUESTION])
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["text", "tool_use", "tool_use"]
    assert message.content[0].text == "Let me check."
    calls = message.content[1:]
    assert [(b.name, b.input) for b in calls] == EXPECTED_CALLS
    assert all(b.id.startswith("toolu_") for b in calls) and calls[0].id != calls[1].id
    assert tools_stack.last_prompt() == "TOOLS: get_weather,get_time | user: Weather in Paris? | assistant:"

    # The client answers each call; the history (the assistant's blocks echoed back) renders as chat.
    follow_up = tools_client.messages.create(model=MODEL, max_tokens=256, tools=[WEATHER_TOOL, TIME_TOOL], messages=[
        QUESTION,
        {"role": "assistant", "content": message.content},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": calls[0].id, "content": "18 degrees, sunny"},
            {"type": "tool_result", "tool_use_id": calls[1].id, "content": [{"type": "text", "text": "12:00"}]},
            {"type": "text", "text": "Thanks!"}]}])
    assert follow_up.stop_reason == "tool_use"
    assert tools_stack.last_prompt() == (
        "TOOLS: get_weather,get_time | user: Weather in Paris? | "
        f"assistant: Let me check.[call {calls[0].id} get_weather Paris][call {calls[1].id} get_time ] | "
        f"tool: 18 degrees, sunny[for {calls[0].id}] | tool: 12:00[for {calls[1].id}] | user: Thanks! | assistant:")


def test_tool_use_streamed(tools_client: anthropic.Anthropic) -> None:
    with tools_client.messages.stream(model=MODEL, max_tokens=256, tools=[WEATHER_TOOL, TIME_TOOL],
                                      tool_choice={"type": "auto"}, messages=[QUESTION]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["text", "tool_use", "tool_use"]
    assert final.content[0].text.strip() == "Let me check."
    assert [(b.name, b.input) for b in final.content[1:]] == EXPECTED_CALLS
    raw = [e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(raw) >= 2  # the input came as JSON fragments
    starts = [e.index for e in events if e.type == "content_block_start"]
    stops = [e.index for e in events if e.type == "content_block_stop"]
    assert starts == stops == [0, 1, 2]


def test_forced_tool(tools_stack: Stack, tools_client: anthropic.Anthropic) -> None:
    message = tools_client.messages.create(model=MODEL, max_tokens=64, tools=[WEATHER_TOOL, TIME_TOOL],
                                           tool_choice={"type": "tool", "name": "get_weather"}, messages=[QUESTION])
    assert tools_stack.fake.requests[-1].sampling.HasField("structured_outputs")  # constrained to the schema
    assert [(b.type, b.name, b.input) for b in message.content] == [("tool_use", "get_weather", {"city": "Oslo"})]
    assert message.stop_reason == "tool_use"


def test_tool_choice_none_is_plain_text(tools_stack: Stack, tools_client: anthropic.Anthropic) -> None:
    message = tools_client.messages.create(model=MODEL, max_tokens=256, tools=[WEATHER_TOOL],
                                           tool_choice={"type": "none"}, messages=[QUESTION])
    assert [b.type for b in message.content] == ["text"] and "<tool_call>" in message.content[0].text
    assert message.stop_reason == "end_turn"
    assert not tools_stack.last_prompt().startswith("TOOLS:")  # the tools are not offered to the model


def test_count_tokens_shows_the_tools(tools_stack: Stack, tools_client: anthropic.Anthropic) -> None:
    counted = tools_client.messages.count_tokens(model=MODEL, tools=[WEATHER_TOOL], messages=[QUESTION])
    message = tools_client.messages.create(model=MODEL, max_tokens=256, tools=[WEATHER_TOOL], messages=[QUESTION])
    assert counted.input_tokens == message.usage.input_tokens == len(tools_stack.fake.requests[-1].prompt_token_ids)
    plain = tools_client.messages.count_tokens(model=MODEL, messages=[QUESTION])
    assert plain.input_tokens < counted.input_tokens
