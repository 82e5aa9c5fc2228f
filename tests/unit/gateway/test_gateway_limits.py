"""The gateway's limits and credentials: 429 with Retry-After beyond the concurrency limit and
its queue, 401 without the API key, OpenAI's bounds on n and logprobs, n > 1 seeds, the bounds
on stop strings, tools, messages and prompt characters, and tokenizing off the event loop."""

from __future__ import annotations

import argparse
import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from support.fake_scheduler import FakeScheduler, FakeSchedulerServer, wait_until
from test_gateway_errors import COMPLETION, MODEL, assert_error

from services.gateway.admission import AdmissionController
from services.gateway.limits import RequestLimits
from services.gateway.options import GatewayOptions, add_gateway_options, gateway_options
from services.gateway.protocol import ChatCompletionToolParam
from services.gateway.server import BackgroundGateway

# ---------------------------------------------------------------------- admission


def test_admission_hands_slots_out_in_arrival_order_and_survives_cancellation() -> None:
    async def scenario() -> list[str]:
        controller = AdmissionController(max_concurrent=1, max_queued=2)
        order: list[str] = []
        await controller.acquire()  # the running one

        async def wait(name: str) -> None:
            await controller.acquire()
            order.append(name)

        first = asyncio.create_task(wait("first"))
        cancelled = asyncio.create_task(wait("cancelled"))
        await asyncio.sleep(0)
        assert controller.num_queued == 2
        with pytest.raises(Exception, match="Too many requests") as full:
            await controller.acquire()
        assert full.value.status_code == 429
        cancelled.cancel()  # a client that gives up while queued leaves the queue
        await asyncio.sleep(0)
        controller.release()
        await first
        assert (controller.num_running, controller.num_queued) == (1, 0)
        controller.release()
        assert controller.num_in_flight == 0
        controller.start_draining()
        with pytest.raises(Exception, match="shutting down"):
            await controller.acquire()
        return order

    assert asyncio.run(scenario()) == ["first"]


def test_beyond_the_limit_and_its_queue_is_a_429_with_retry_after(smollm2_dir: str) -> None:
    fake = FakeScheduler()
    fake.running.clear()  # requests sit in the engine until we let them run
    options = GatewayOptions(max_concurrent_requests=1, max_queued_requests=1)
    body = {**COMPLETION, "max_tokens": 3}
    with FakeSchedulerServer(fake) as scheduler, BackgroundGateway(scheduler.address, smollm2_dir,
                                                                   options=options) as gw, \
            ThreadPoolExecutor(2) as pool:
        running = pool.submit(httpx.post, f"{gw.url}/v1/completions", json=body, timeout=10)
        wait_until(lambda: len(fake.requests) == 1, what="the first request to reach the engine")
        queued = pool.submit(httpx.post, f"{gw.url}/v1/completions", json={**body, "stream": True}, timeout=10)
        wait_until(lambda: gw_admission(gw).num_queued == 1, what="the second request to queue")
        response = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=10)
        assert_error(response, 429, code="too_many_requests", error_type="rate_limit_error",
                     message_has=("--max-concurrent-requests 1",))
        assert response.headers["retry-after"] == "1"
        # The Responses and Messages routes share the limit; Anthropic's clients get its error shape.
        responses = httpx.post(f"{gw.url}/v1/responses", json={"model": MODEL, "input": "hi"}, timeout=10)
        assert_error(responses, 429, code="too_many_requests", error_type="rate_limit_error")
        messages = httpx.post(f"{gw.url}/v1/messages", timeout=10, json={
            "model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
        assert messages.status_code == 429 and messages.headers["retry-after"] == "1"
        assert messages.json() == {"type": "error", "error": {"type": "rate_limit_error",
                                                              "message": messages.json()["error"]["message"]}}
        assert httpx.get(f"{gw.url}/v1/models").status_code == 200  # only generation is limited
        fake.running.set()
        assert running.result().status_code == 200 and queued.result().status_code == 200
        assert len(fake.requests) == 2  # the refused one never reached the engine
        # /metrics counts the three refusals as vLLM's frontend does (reason: its queue was full).
        metrics = httpx.get(f"{gw.url}/metrics").text
        assert f'vllm:admission_rejections_total{{model_name="{MODEL}",reason="max_num_queued_reqs"}} 3.0' in metrics
        assert httpx.post(f"{gw.url}/v1/completions", json=body, timeout=10).status_code == 200


def gw_admission(gateway: BackgroundGateway) -> AdmissionController:
    return gateway._server.config.app.state.admission


# ---------------------------------------------------------------------- API key


def test_api_key_is_required_on_v1_routes_only(smollm2_dir: str) -> None:
    options = GatewayOptions(api_key="sekret")
    with FakeSchedulerServer() as scheduler, BackgroundGateway(scheduler.address, smollm2_dir,
                                                               options=options) as gw:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
                response = httpx.request(method, f"{gw.url}{path}", json=COMPLETION, headers=headers, timeout=10)
                assert_error(response, 401, code="invalid_api_key")
        for path in ("/health", "/metrics"):
            assert httpx.get(f"{gw.url}{path}").status_code == 200
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="sekret", max_retries=0, timeout=10)
        assert client.completions.create(model=MODEL, prompt="hello", max_tokens=2).choices[0].text
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{gw.url}/v1", api_key="nope", max_retries=0).models.list()


# ---------------------------------------------------------------------- OpenAI's bounds


@pytest.fixture(scope="module")
def url(smollm2_dir: str):
    with FakeSchedulerServer() as scheduler, BackgroundGateway(scheduler.address, smollm2_dir) as gw:
        yield gw.url


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/completions", {"n": 129}, "n"),
    ("/v1/chat/completions", {"n": 129}, "n"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_n_and_logprobs_are_bounded_as_openai(url: str, path: str, extra: dict, param: str) -> None:
    body = {"model": MODEL, **({"prompt": "hi"} if path == "/v1/completions" else
                               {"messages": [{"role": "user", "content": "hi"}]}), **extra}
    assert_error(httpx.post(f"{url}{path}", json=body, timeout=10), 400, param=param)


def test_n_128_is_fine(url: str) -> None:
    response = httpx.post(f"{url}/v1/completions", json={**COMPLETION, "n": 128, "max_tokens": 1}, timeout=30)
    assert response.status_code == 200 and len(response.json()["choices"]) == 128


def test_prompts_times_n_is_bounded_before_any_prompt_is_tokenized(url: str) -> None:
    """One HTTP request may become at most --max-choices-per-request (256) engine requests."""
    body = {**COMPLETION, "prompt": ["hi"] * 3, "n": 100, "max_tokens": 1}
    error = assert_error(httpx.post(f"{url}/v1/completions", json=body, timeout=10), 400, param="prompt")
    assert "3 prompts x n=100 = 300 completions; at most 256" in error["message"]
    body = {**COMPLETION, "prompt": [[5]] * 100_000, "max_tokens": 1}  # not 100,000 token checks first
    assert_error(httpx.post(f"{url}/v1/completions", json=body, timeout=10), 400, param="prompt")
    body = {**COMPLETION, "prompt": ["hi"] * 2, "n": 128, "max_tokens": 1}  # exactly 256: fine
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200 and len(response.json()["choices"]) == 256


def test_n_seeded_choices_get_the_offline_llms_seeds(smollm2_dir: str) -> None:
    """seed, seed+1, ... per choice (`sampling_for_choice`, shared with the offline LLM)."""
    fake = FakeScheduler()
    with FakeSchedulerServer(fake) as scheduler, BackgroundGateway(scheduler.address, smollm2_dir) as gw:
        body = {**COMPLETION, "n": 3, "seed": 7, "max_tokens": 2, "temperature": 1.0}
        assert httpx.post(f"{gw.url}/v1/completions", json=body, timeout=10).status_code == 200
        assert sorted(r.sampling.seed for r in fake.requests) == [7, 8, 9]
        fake.requests.clear()
        assert httpx.post(f"{gw.url}/v1/completions", json={**body, "seed": None}, timeout=10).status_code == 200
        assert not any(r.sampling.HasField("seed") for r in fake.requests)


# ---------------------------------------------------------------------- request bounds

SMALL_LIMITS = RequestLimits(max_stop_strings=4, max_stop_string_length=8, max_tools=3,
                             max_tool_definition_bytes=200, max_messages=6, max_prompt_chars_per_token=16)
SMALL_MAX_MODEL_LEN = 256  # prompts of at most 16 x 256 = 4096 characters
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
PATHS = ("/v1/completions", "/v1/chat/completions")


class _Bounded:
    """A gateway with small request limits, and a count of the texts its tokenizer encoded."""

    def __init__(self, gateway: BackgroundGateway) -> None:
        self.url = gateway.url
        self.tokenizer = gateway.app.state.ctx.tokenizer
        self.encoded: list[int] = []  # lengths of the texts encoded
        encode = self.tokenizer.encode

        def counting_encode(text: str, add_special_tokens: bool = True) -> list[int]:
            self.encoded.append(len(text))
            return encode(text, add_special_tokens)

        self.tokenizer.encode = counting_encode

    def post(self, path: str, body: dict) -> httpx.Response:
        base = COMPLETION if path == "/v1/completions" else CHAT
        return httpx.post(f"{self.url}{path}", json={**base, "max_tokens": 1, **body}, timeout=30)


@pytest.fixture(scope="module")
def bounded(smollm2_dir: str):
    fake = FakeScheduler(max_model_len=SMALL_MAX_MODEL_LEN)
    with FakeSchedulerServer(fake) as scheduler, \
            BackgroundGateway(scheduler.address, smollm2_dir, options=GatewayOptions(limits=SMALL_LIMITS)) as gw:
        yield _Bounded(gw)


@pytest.mark.parametrize("path", PATHS)
def test_stop_strings_are_bounded_in_number_and_length(bounded: _Bounded, path: str) -> None:
    assert bounded.post(path, {"stop": ["a", "b", "c", "12345678"]}).status_code == 200  # at both limits
    assert bounded.post(path, {"stop": "12345678"}).status_code == 200
    error = assert_error(bounded.post(path, {"stop": ["a", "b", "c", "d", "e"]}), 400, param="stop")
    assert error["message"] == "5 stop strings; at most 4 per request (--max-stop-strings)"
    error = assert_error(bounded.post(path, {"stop": ["a", "123456789"]}), 400, param="stop[1]")
    assert error["message"] == "a stop string of 9 characters; at most 8 (--max-stop-string-length)"
    assert_error(bounded.post(path, {"stop": "123456789"}), 400, param="stop")


def _tool(name: str, size: int) -> dict:
    """A tool definition of exactly `size` bytes as the gateway serializes it."""
    def make(description: str) -> dict:
        return {"type": "function", "function": {"name": name, "description": description}}

    overhead = len(ChatCompletionToolParam.model_validate(make("")).model_dump_json(exclude_none=True))
    tool = make("x" * (size - overhead))
    assert len(ChatCompletionToolParam.model_validate(tool).model_dump_json(exclude_none=True)) == size
    return tool


def test_tools_are_bounded_in_number_and_size(bounded: _Bounded) -> None:
    path = "/v1/chat/completions"
    tools = [_tool("a", 100), _tool("b", 100), _tool("c", 200)]  # at both limits
    for choice in ("none", {"type": "function", "function": {"name": "c"}}):
        assert bounded.post(path, {"tools": tools, "tool_choice": choice}).status_code == 200
    error = assert_error(bounded.post(path, {"tools": tools + [_tool("d", 100)], "tool_choice": "none"}), 400,
                         param="tools")
    assert error["message"] == "4 tools; at most 3 per request (--max-tools)"
    error = assert_error(bounded.post(path, {"tools": [_tool("a", 100), _tool("b", 201)], "tool_choice": "none"}),
                         400, param="tools[1]")
    assert error["message"] == "a tool definition of 201 bytes (as JSON); at most 200 (--max-tool-definition-bytes)"


def test_chat_messages_are_bounded(bounded: _Bounded) -> None:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(7)]
    assert bounded.post("/v1/chat/completions", {"messages": messages[:6]}).status_code == 200
    bounded.encoded.clear()
    error = assert_error(bounded.post("/v1/chat/completions", {"messages": messages}), 400, param="messages")
    assert error["message"] == "7 messages; at most 6 per request (--max-messages)"
    response = httpx.post(f"{bounded.url}/tokenize", json={"messages": messages}, timeout=10)
    assert_error(response, 400, param="messages", message_has=("--max-messages",))
    assert bounded.encoded == []


def _chars_error(response: httpx.Response, param: str, chars: int) -> None:
    assert_error(response, 400, param=param, code="context_length_exceeded", message_has=(
        f"maximum context length is {SMALL_MAX_MODEL_LEN} tokens", f"the prompt has {chars} characters, more than "
        "the 4096 (16 per token) a prompt may have before it is tokenized (--max-prompt-chars-per-token)"))


def test_prompt_characters_are_bounded_before_tokenizing(bounded: _Bounded) -> None:
    """At most 16 characters per token of max_model_len (256): 4096. A run of "=" is 64 characters
    a token, so 4096 of them fit the context; 4097 are refused without being tokenized."""
    at_limit = "=" * 4096
    assert bounded.post("/v1/completions", {"prompt": at_limit}).status_code == 200
    assert bounded.post("/v1/completions", {"prompt": ["hi", at_limit]}).status_code == 200
    assert httpx.post(f"{bounded.url}/tokenize", json={"prompt": at_limit}, timeout=10).status_code == 200
    overhead = len(bounded.tokenizer.render_chat([{"role": "user", "content": ""}]))
    content = "=" * (4096 - overhead)  # the rendered prompt: exactly 4096 characters
    assert bounded.post("/v1/chat/completions", {"messages": [{"role": "user", "content": content}]}).status_code == 200

    bounded.encoded.clear()
    _chars_error(bounded.post("/v1/completions", {"prompt": at_limit + "="}), "prompt", 4097)
    _chars_error(bounded.post("/v1/completions", {"prompt": ["hi", at_limit + "="]}), "prompt", 4097)
    _chars_error(httpx.post(f"{bounded.url}/tokenize", json={"prompt": at_limit + "="}, timeout=10), "prompt", 4097)
    response = bounded.post("/v1/chat/completions", {"messages": [{"role": "user", "content": content + "="}]})
    _chars_error(response, "messages", 4097)
    response = bounded.post("/v1/completions", {"prompt": "x" * (7 * 1024 * 1024)})
    _chars_error(response, "prompt", 7 * 1024 * 1024)
    assert bounded.encoded == []  # none of them was tokenized (not even "hi", the first prompt)


def test_a_prompt_within_the_characters_but_over_the_tokens_is_refused_after_tokenizing(bounded: _Bounded) -> None:
    prompt = "hello " * 300  # 1800 characters, 300 tokens: over max_model_len 256
    for path, body, param in (("/v1/completions", {"prompt": prompt}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]},
                               "messages")):
        assert_error(bounded.post(path, body), 400, param=param, code="context_length_exceeded",
                     message_has=(f"maximum context length is {SMALL_MAX_MODEL_LEN} tokens", f"in the {param}, 1 in "
                                  "the completion"))


def test_token_id_prompts_over_the_context_are_refused_before_they_are_checked_or_decoded(bounded: _Bounded) -> None:
    decode = bounded.tokenizer.decode
    decoded: list[int] = []
    bounded.tokenizer.decode = lambda ids, **kwargs: decoded.append(len(ids)) or decode(ids, **kwargs)
    try:
        # An out-of-vocabulary id in a prompt over the context: the context is what is reported.
        response = bounded.post("/v1/completions", {"prompt": [[5], [5] * 300 + [10**9]], "max_tokens": None})
        assert_error(response, 400, param="prompt", code="context_length_exceeded",
                     message_has=("your request has 301 input tokens",))
        assert decoded == []
        assert bounded.post("/v1/completions", {"prompt": [5] * 200, "echo": True}).status_code == 200
        assert 200 in decoded
    finally:
        del bounded.tokenizer.decode


def test_a_template_error_raised_in_the_tokenizer_pool_is_still_a_400(smollm2_dir: str) -> None:
    template = "{% if messages[0].role == 'system' %}{{ raise_exception('no system role here') }}{% endif %}" \
               "{{ messages[0].content }}"
    with FakeSchedulerServer() as scheduler, \
            BackgroundGateway(scheduler.address, smollm2_dir, options=GatewayOptions(chat_template=template)) as gw:
        messages = [{"role": "system", "content": "hi"}]
        for path, body in (("/v1/chat/completions", {**CHAT, "messages": messages}),
                           ("/tokenize", {"messages": messages})):
            assert_error(httpx.post(f"{gw.url}{path}", json=body, timeout=10), 400, param="messages",
                         message_has=("Could not apply the chat template", "no system role here"))
        assert httpx.post(f"{gw.url}/v1/chat/completions", json=CHAT, timeout=10).status_code == 200


def test_default_bounds(url: str) -> None:
    """64 stop strings of 1024 characters, 128 tools, 4096 messages (the flags' defaults)."""
    body = {**COMPLETION, "max_tokens": 1}
    assert httpx.post(f"{url}/v1/completions", json={**body, "stop": ["s" * 1024] * 64}, timeout=10).status_code == 200
    assert_error(httpx.post(f"{url}/v1/completions", json={**body, "stop": ["s"] * 65}, timeout=10), 400,
                 param="stop", message_has=("at most 64",))
    assert_error(httpx.post(f"{url}/v1/completions", json={**body, "stop": ["s" * 1025]}, timeout=10), 400,
                 param="stop[0]", message_has=("at most 1024",))
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    response = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "tools": tools, "tool_choice": "none"},
                          timeout=10)
    assert_error(response, 400, param="tools", message_has=("129 tools; at most 128",))
    messages = [{"role": "user", "content": "."}] * 4097
    assert_error(httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "messages": messages}, timeout=10), 400,
                 param="messages", message_has=("4097 messages; at most 4096",))


def test_the_bounds_are_flags_shown_in_help() -> None:
    parser = argparse.ArgumentParser()
    add_gateway_options(parser)
    flags = ("--max-stop-strings", "--max-stop-string-length", "--max-tools", "--max-tool-definition-bytes",
             "--max-messages", "--max-prompt-chars-per-token", "--tokenizer-pool-size")
    help_text = parser.format_help()
    assert all(flag in help_text for flag in flags)
    assert gateway_options(parser.parse_args([])).limits == RequestLimits()
    options = gateway_options(parser.parse_args([f"{flag}={i + 1}" for i, flag in enumerate(flags)]))
    assert options.limits == RequestLimits(1, 2, 3, 4, 5, 6) and options.tokenizer_pool_size == 7
    assert gateway_options(parser.parse_args(["--max-prompt-chars-per-token=0"])).limits.max_prompt_chars_per_token == 0
    for flag in flags:
        with pytest.raises(ValueError, match=flag):
            gateway_options(parser.parse_args([f"{flag}=-1"]))


# ---------------------------------------------------------------------- tokenizing off the event loop


def test_the_event_loop_serves_other_requests_while_a_prompt_is_tokenized(smollm2_dir: str) -> None:
    """A big prompt's tokenizing is held (the tokenizer waits on an event) until the test lets
    it go: meanwhile /health answers and a whole streamed completion runs. Were the prompt
    tokenized on the event loop, neither could answer before it was let go."""
    big = "hello world, " * 40_000  # 520,000 characters: legal with max_model_len 1M
    requests = [("/v1/completions", {**COMPLETION, "prompt": big, "max_tokens": 1}),
                ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": big}]}),
                ("/tokenize", {"prompt": big})]
    fake = FakeScheduler(max_model_len=1 << 20)
    with FakeSchedulerServer(fake) as scheduler, BackgroundGateway(scheduler.address, smollm2_dir) as gw, \
            ThreadPoolExecutor(1) as pool:
        tokenizer = gw.app.state.ctx.tokenizer
        encode = tokenizer.encode
        entered, release = threading.Event(), threading.Event()
        threads: set[str] = set()

        def held_encode(text: str, add_special_tokens: bool = True) -> list[int]:
            threads.add(threading.current_thread().name)
            if len(text) >= len(big):
                entered.set()
                release.wait(60)
            return encode(text, add_special_tokens)

        tokenizer.encode = held_encode
        try:
            for path, body in requests:
                entered.clear()
                release.clear()
                held = pool.submit(httpx.post, f"{gw.url}{path}", json=body, timeout=90)
                assert entered.wait(30), f"{path}: the big prompt was never tokenized"
                assert httpx.get(f"{gw.url}/health", timeout=10).status_code == 200
                stream = httpx.post(f"{gw.url}/v1/completions", timeout=10,
                                    json={**COMPLETION, "max_tokens": 3, "stream": True})
                assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
                assert not held.done()  # all of that while the big prompt was still being tokenized
                release.set()
                assert held.result().status_code == 200, held.result().text
        finally:
            release.set()
            del tokenizer.encode
        assert threads and all(name.startswith("myvllm-tokenizer") for name in threads), threads
