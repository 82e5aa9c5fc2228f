"""Every bad input gets an OpenAI-shaped error with the right status, type and param;
a missing or dying scheduler gives a prompt 503, never a hang."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from support.fake_scheduler import FakeScheduler, FakeSchedulerServer, wait_until

from services.common.proto import myvllm_pb2 as pb
from services.gateway.migration import MigrationPolicy
from services.gateway.options import GatewayOptions
from services.gateway.readiness import NOT_READY_MESSAGE
from services.gateway.server import BackgroundGateway, PortInUseError, bind_socket, serve_gateway
from services.text.tokenizer import Tokenizer

MODEL = "SmolLM2-135M-Instruct"  # the served name: the model directory's basename
MAX_MODEL_LEN = 256
MESSAGES = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": MESSAGES}
COMPLETION = {"model": MODEL, "prompt": "hello"}


def reject_long_prompts(request: Any) -> str | None:
    return "prompt needs more KV blocks than exist" if len(request.prompt_token_ids) > 100 else None


@pytest.fixture(scope="module")
def url(smollm2_dir: str) -> Iterator[str]:
    fake = FakeScheduler(max_model_len=MAX_MODEL_LEN, reject=reject_long_prompts)
    with FakeSchedulerServer(fake) as scheduler, \
            BackgroundGateway(scheduler.address, smollm2_dir, max_body_bytes=64 * 1024) as gateway:
        yield gateway.url


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None,
                 error_type: str = "invalid_request_error", message_has: tuple[str, ...] = ()) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    for fragment in message_has:
        assert fragment in error["message"], error["message"]
    return error


# What a client must never read: an internal address or port, or gRPC's status text.
INTERNAL = re.compile(r"\d+\.\d+\.\d+\.\d+|:\d+|UNAVAILABLE|StatusCode|DEADLINE_EXCEEDED|failed to connect|"
                      r"Connection refused|scheduler at")


def assert_retryable_and_internal_free(response: httpx.Response) -> None:
    assert response.headers["retry-after"] == "1", response.headers
    assert not INTERNAL.search(response.text), response.text


def dead_address() -> str:
    with FakeSchedulerServer() as server:
        address = server.address
    return address


# ---------------------------------------------------------------------- malformed bodies


def test_invalid_json(url: str) -> None:
    response = httpx.post(f"{url}/v1/chat/completions", content=b'{"model": "x", ',
                          headers={"content-type": "application/json"})
    assert_error(response, 400, message_has=("Invalid JSON",))


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"model": MODEL}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"content": "no role"}]}, "messages[0].role"),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 1.5}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "stop": 5}, "stop"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"1": "high"}}, "logit_bias.1"),
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "n": "two"}, "n"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_schema_errors_are_400_naming_the_field(url: str, path: str, body: dict, param: str) -> None:
    error = assert_error(httpx.post(f"{url}{path}", json=body), 400, param=param)
    assert error["message"].startswith(param)


# ---------------------------------------------------------------------- sampling values


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": 1.5}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "top_k": -5}, "top_k"),
    ("/v1/chat/completions", {**CHAT, "min_p": 2}, "min_p"),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": 3}, "frequency_penalty"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": -3}, "presence_penalty"),
    ("/v1/chat/completions", {**CHAT, "n": 0}, "n"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ("/v1/chat/completions", {**CHAT, "stop": ["ok", ""]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"not-a-token": 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {**COMPLETION, "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {**COMPLETION, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, 99999999]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ""}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": []}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "seed": 2**70}, "seed"),
    ("/v1/chat/completions", {**CHAT, "priority": 2**40}, "priority"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"tokenize": True}}, "messages"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/tokenize", {}, "prompt"),
    # vLLM's fields.
    ("/v1/chat/completions", {**CHAT, "allowed_token_ids": [1, 99999999]}, "allowed_token_ids"),
    ("/v1/completions", {**COMPLETION, "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {**COMPLETION, "allowed_token_ids": [-1]}, "allowed_token_ids"),
    ("/v1/completions", {**COMPLETION, "truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens"),
    ("/v1/completions", {**COMPLETION, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {**CHAT, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {**CHAT, "truncation_side": "middle"}, "truncation_side"),
    ("/v1/chat/completions", {**CHAT, "reasoning_effort": "extreme"}, "reasoning_effort"),
    ("/v1/chat/completions", {**CHAT, "request_id": "r" * 201}, "request_id"),
    ("/v1/chat/completions", {**CHAT, "guided_regex": "(unclosed"}, "guided_regex"),
    ("/v1/chat/completions", {**CHAT, "guided_choice": []}, "guided_choice"),
    ("/v1/chat/completions", {**CHAT, "guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ("/v1/completions", {**COMPLETION, "guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {**COMPLETION, "guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex"),
    ("/v1/chat/completions", {**CHAT, "vllm_xargs": {"k": {"nested": 1}}}, "vllm_xargs.k"),
])
def test_bad_values_are_400_naming_the_field(url: str, path: str, body: dict, param: str) -> None:
    assert_error(httpx.post(f"{url}{path}", json=body), 400, param=param)


# ---------------------------------------------------------------------- unsupported features


@pytest.mark.parametrize(("path", "extra", "feature"), [
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"logits_processors": ["x"]}, "logits_processors"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    # vLLM's fields whose values ask for what this server lacks.
    ("/v1/chat/completions", {"use_beam_search": True, "n": 2}, "use_beam_search"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/chat/completions", {"best_of": 2}, "best_of"),
    ("/v1/chat/completions", {"mm_processor_kwargs": {"num_crops": 4}}, "mm_processor_kwargs"),
    ("/v1/chat/completions", {"media_io_kwargs": {"image": {"x": 1}}}, "media_io_kwargs"),
    ("/v1/chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", {"watermarking": True}, "watermarking"),
    ("/v1/chat/completions", {"logprob_token_ids": [1, 2], "logprobs": True}, "logprob_token_ids"),
    ("/v1/chat/completions", {"thinking_token_budget": 10}, "thinking_token_budget"),
    ("/v1/chat/completions", {"repetition_detection": {"max_pattern_size": 4}}, "repetition_detection"),
    ("/v1/chat/completions", {"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ("/v1/chat/completions", {"guided_regex": "a+", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ("/v1/chat/completions", {"guided_regex": "a+", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ("/v1/completions", {"structural_tag": "{}"}, "structural_tag"),
    ("/v1/completions", {"prompt_embeds": "AAAA"}, "prompt_embeds"),
])
def test_unsupported_features_are_400(url: str, path: str, extra: dict, feature: str) -> None:
    body = {**(CHAT if "chat" in path else COMPLETION), **extra}
    assert_error(httpx.post(f"{url}{path}", json=body), 400, param=feature, message_has=("is not supported",))


def test_auto_tool_choice_needs_the_server_flags(url: str) -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    for extra in ({"tools": tools}, {"tools": tools, "tool_choice": "auto"}):
        assert_error(httpx.post(f"{url}/v1/chat/completions", json={**CHAT, **extra}), 400, param="tool_choice",
                     message_has=("--enable-auto-tool-choice",))
    assert_error(httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "tool_choice": "auto"}), 400,
                 param="tool_choice", message_has=("needs tools",))


def test_non_text_content_parts_are_unsupported(url: str) -> None:
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    assert_error(httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "messages": messages}), 400,
                 param="messages[0].content[0].type", message_has=("'image_url' is not supported",))


def test_supported_defaults_of_unsupported_fields_are_fine(url: str) -> None:
    body = {**CHAT, "max_tokens": 2, "response_format": {"type": "text"}, "tool_choice": "none",
            "modalities": ["text"], "user": "u", "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
            "stream_options": None}
    assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 200


@pytest.fixture(scope="module")
def strict_url(smollm2_dir: str) -> Iterator[str]:
    """A gateway started with --strict-request-fields."""
    with FakeSchedulerServer(FakeScheduler(max_model_len=MAX_MODEL_LEN)) as scheduler, \
            BackgroundGateway(scheduler.address, smollm2_dir,
                              options=GatewayOptions(strict_request_fields=True)) as gateway:
        yield gateway.url


@pytest.mark.parametrize(("path", "body", "named"), [
    ("/v1/chat/completions", {**CHAT, "temprature": 0.5}, "temprature"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2, "stream": True,
                              "stream_options": {"include_usage": True, "usage": 1}}, "stream_options.usage"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "args": {}}}]},
     "tools[0].function.args"),
    ("/v1/completions", {**COMPLETION, "frobnicate": True, "temprature": 1.0}, "frobnicate, temprature"),
    ("/tokenize", {"prompt": "hi", "return_token_strs": True}, "return_token_strs"),
])
def test_unknown_fields_are_400_naming_them_when_strict(strict_url: str, path: str, body: dict, named: str) -> None:
    """Under --strict-request-fields a misspelt or unimplemented field is refused by name (OpenAI's
    answer), not silently dropped (without the flag it is ignored and logged, as vLLM does:
    test_gateway_api.py)."""
    param = named.split(", ")[0]
    assert_error(httpx.post(f"{strict_url}{path}", json=body), 400, param=param,
                 message_has=(f"Unrecognized request argument supplied: {named}",))


def test_vllm_fields_are_known_when_strict(strict_url: str) -> None:
    """vLLM's fields are declared: --strict-request-fields refuses only what neither OpenAI nor vLLM knows."""
    body = {**CHAT, "max_tokens": 2, "use_beam_search": False, "length_penalty": 1.0, "request_id": "r",
            "mm_processor_kwargs": {}, "vllm_xargs": {"k": 1}, "return_token_ids": True, "session_id": "s"}
    assert httpx.post(f"{strict_url}/v1/chat/completions", json=body).status_code == 200


# ---------------------------------------------------------------------- context length


def test_prompt_plus_max_tokens_over_the_context(url: str, smollm2_dir: str) -> None:
    tokenizer = Tokenizer.load(smollm2_dir)
    num_prompt = len(tokenizer.encode(tokenizer.render_chat(MESSAGES), add_special_tokens=False))
    response = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 250})
    assert_error(response, 400, param="messages", code="context_length_exceeded", message_has=(
        f"maximum context length is {MAX_MODEL_LEN} tokens",
        f"you requested {num_prompt + 250} tokens ({num_prompt} in the messages, 250 in the completion)"))
    num_prompt = len(tokenizer.encode("hello"))
    response = httpx.post(f"{url}/v1/completions", json={**COMPLETION, "max_tokens": 300})
    assert_error(response, 400, param="prompt", code="context_length_exceeded",
                 message_has=(f"({num_prompt} in the prompt, 300 in the completion)",))


def test_prompt_alone_over_the_context(url: str) -> None:
    response = httpx.post(f"{url}/v1/completions", json={**COMPLETION, "prompt": [5] * 300, "max_tokens": None})
    assert_error(response, 400, param="prompt", code="context_length_exceeded",
                 message_has=(f"maximum context length is {MAX_MODEL_LEN} tokens", "300 input tokens"))
    # The completions default (16 tokens) counts against the context too.
    response = httpx.post(f"{url}/v1/completions", json={**COMPLETION, "prompt": [5] * 250})
    assert_error(response, 400, param="prompt", code="context_length_exceeded",
                 message_has=("(250 in the prompt, 16 in the completion)",))


def test_request_rejected_by_the_engine_is_400(url: str) -> None:
    for stream in (False, True):
        response = httpx.post(f"{url}/v1/completions", json={**COMPLETION, "prompt": [5] * 150, "max_tokens": 5,
                                                             "stream": stream})
        assert_error(response, 400, code="rejected_by_engine", message_has=("more KV blocks",))


# ---------------------------------------------------------------------- model, routes, size


def test_unknown_model_is_404(url: str) -> None:
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION),
                       ("/tokenize", {"prompt": "x"})):
        response = httpx.post(f"{url}{path}", json={**body, "model": "gpt-17"})
        assert_error(response, 404, param="model", code="model_not_found", message_has=("gpt-17",))
    assert_error(httpx.get(f"{url}/v1/models/gpt-17"), 404, param="model", code="model_not_found")


def test_unknown_route_and_method(url: str) -> None:
    assert_error(httpx.get(f"{url}/v1/nothing"), 404, code="not_found")
    assert_error(httpx.get(f"{url}/v1/completions"), 405)


def test_body_over_the_limit_is_413(url: str) -> None:
    big = {**COMPLETION, "prompt": "x" * (65 * 1024)}
    assert_error(httpx.post(f"{url}/v1/completions", json=big), 413, code="request_too_large",
                 message_has=("limit of 65536 bytes",))

    def chunked_body() -> Iterator[bytes]:  # no Content-Length: the limit must still hold
        yield b'{"model": "x", "prompt": "'
        for _ in range(100):
            yield b"y" * 1024
        yield b'"}'

    response = httpx.post(f"{url}/v1/completions", content=chunked_body(), headers={"content-type": "application/json"})
    assert_error(response, 413, code="request_too_large")


def test_default_body_limit_is_8_mib(smollm2_dir: str) -> None:
    """The client sends its whole oversized body before reading, and gets the whole 413 each
    time (not a connection reset racing it): 50 times, declared and chunked bodies in turn."""
    payload = b'{"prompt": "' + b"z" * (8 * 1024 * 1024) + b'"}'

    def chunked() -> Iterator[bytes]:
        for start in range(0, len(payload), 1 << 20):
            yield payload[start:start + (1 << 20)]

    with FakeSchedulerServer() as scheduler, BackgroundGateway(scheduler.address, smollm2_dir) as gateway, \
            httpx.Client(timeout=30) as client:
        for attempt in range(50):
            response = client.post(f"{gateway.url}/v1/completions", content=chunked() if attempt % 2 else payload,
                                   headers={"content-type": "application/json"})
            size = "at least" if attempt % 2 else str(len(payload))
            assert_error(response, 413, code="request_too_large",
                         message_has=(size, f"limit of {8 * 1024 * 1024} bytes"))
            assert response.headers["connection"] == "close"


# ---------------------------------------------------------------------- scheduler down


def test_nothing_is_served_before_a_replica_is_ready(smollm2_dir: str) -> None:
    """Start-up: a gateway up before its scheduler answers every /v1 route with a fast 503 +
    Retry-After that names no address, until the scheduler answers with the model's config; a
    readiness poll on /v1/models never sees 200 before a completion can run, and sees the real
    max_model_len then."""
    address = dead_address()
    fake = FakeScheduler(max_model_len=0)  # once up: answers, but has no config to report yet
    anthropic = {"model": MODEL, "max_tokens": 3, "messages": MESSAGES}
    gateway = BackgroundGateway(address, smollm2_dir)  # its port is bound, the app not yet started
    with pytest.raises(ConnectionRefusedError):  # refused, not left waiting in a listen backlog
        socket.create_connection((gateway.host, gateway.port), timeout=5).close()
    with gateway:
        for method, path, body in (("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/completions", COMPLETION),
                                   ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
                                   ("POST", "/v1/completions", {**COMPLETION, "stream": True, "max_tokens": 5}),
                                   ("POST", "/v1/responses", {"model": MODEL, "input": "hi"}),
                                   ("POST", "/v1/embeddings", {"model": MODEL, "input": "hi"}),
                                   ("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None)):
            started = time.monotonic()
            response = httpx.request(method, f"{gateway.url}{path}", json=body, timeout=10)
            assert time.monotonic() - started < 2
            assert_error(response, 503, code="server_starting", error_type="service_unavailable_error",
                         message_has=(NOT_READY_MESSAGE,))
            assert_retryable_and_internal_free(response)
        messages = httpx.post(f"{gateway.url}/v1/messages", json=anthropic, timeout=10)  # in Anthropic's shape
        assert messages.status_code == 503 and messages.json() == {
            "type": "error", "error": {"type": "overloaded_error", "message": NOT_READY_MESSAGE}}
        assert_retryable_and_internal_free(messages)
        started = time.monotonic()
        health = httpx.get(f"{gateway.url}/health", timeout=10)
        assert_error(health, 503, error_type="service_unavailable_error")
        assert time.monotonic() - started < 2
        assert_retryable_and_internal_free(health)
        metrics = httpx.get(f"{gateway.url}/metrics").text  # the operator's view answers before readiness
        assert f'myvllm:scheduler_up{{model_name="{MODEL}"}} 0.0' in metrics
        assert httpx.get(f"{gateway.url}/").status_code == 200

        # A readiness probe polls /v1/models and /v1/completions while the scheduler comes up.
        seen: list[tuple[float, str, httpx.Response]] = []
        done = threading.Event()

        def poll() -> None:
            while not done.is_set():
                for method, path, body in (("GET", "/v1/models", None),
                                           ("POST", "/v1/completions", {**COMPLETION, "max_tokens": 3})):
                    response = httpx.request(method, f"{gateway.url}{path}", json=body, timeout=10)
                    seen.append((time.monotonic(), path, response))
                time.sleep(0.02)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            time.sleep(0.3)
            with FakeSchedulerServer(fake, port=int(address.rsplit(":", 1)[1])):
                time.sleep(0.5)  # answering, no max_model_len yet: still not ready
                config_known_at = time.monotonic()
                fake.max_model_len = MAX_MODEL_LEN
                wait_until(lambda: {p for _, p, r in seen if r.status_code == 200} == {"/v1/models", "/v1/completions"},
                           timeout_s=10, what="the gateway to serve")
                done.set()
                poller.join(timeout=10)
                before = [r for t, _, r in seen if t < config_known_at]
                assert before and all(r.status_code == 503 for r in before), [r.text for r in before]
                for response in before:
                    assert response.json()["error"]["code"] == "server_starting"
                    assert_retryable_and_internal_free(response)
                first_ok = next(i for i, (_, _, r) in enumerate(seen) if r.status_code == 200)
                assert all(r.status_code == 200 for _, _, r in seen[first_ok:]), [r.text for _, _, r in seen]
                for _, path, response in seen[first_ok:]:
                    if path == "/v1/models":
                        assert response.json()["data"][0]["max_model_len"] == MAX_MODEL_LEN
                    else:
                        assert response.json()["choices"][0]["text"]
                assert httpx.get(f"{gateway.url}/health", timeout=10).status_code == 200
        finally:
            done.set()
            poller.join(timeout=10)


def test_hung_scheduler_is_a_503_within_2_seconds(smollm2_dir: str) -> None:
    with socket.socket() as silent:  # accepts TCP connections, never answers a byte
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        with BackgroundGateway(address, smollm2_dir) as gateway:
            for body in (CHAT, {**CHAT, "stream": True}):
                started = time.monotonic()
                response = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=10)
                assert time.monotonic() - started < 2
                assert_error(response, 503, code="server_starting", error_type="service_unavailable_error")
                assert_retryable_and_internal_free(response)


def test_stream_survives_its_scheduler_restarting(smollm2_dir: str) -> None:
    fake = FakeScheduler(step_delay_s=0.02)
    body = {**CHAT, "stream": True, "max_tokens": 60, "ignore_eos": True}
    with FakeSchedulerServer(fake) as scheduler, BackgroundGateway(scheduler.address, smollm2_dir) as gw:
        expected = _streamed_text(httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=10).text)
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=10) as response:
            lines = response.iter_lines()
            head = [next(lines) for _ in range(6)]
            scheduler.stop()  # the stream breaks mid-generation...
            time.sleep(0.5)
            scheduler.start()  # ...and the same replica comes back (same port)
            text = _streamed_text("\n".join(head + list(lines)))
        assert text == expected and len(expected) == 60  # one character per scripted token
        resumed = fake.requests[-1]
        assert resumed.request_id.endswith("-m1") and len(resumed.resumed_output_token_ids) >= 1
        assert 'myvllm:request_migrations_total{model_name="SmolLM2-135M-Instruct"} 1.0' in \
            httpx.get(f"{gw.url}/metrics").text


def test_migration_gives_up_with_an_sse_error_or_a_503(smollm2_dir: str) -> None:
    fake = FakeScheduler(step_delay_s=0.05)
    options = GatewayOptions(migration=MigrationPolicy(wait_s=1.0))
    with FakeSchedulerServer(fake) as scheduler, BackgroundGateway(scheduler.address, smollm2_dir,
                                                                   options=options) as gw:
        body = {**CHAT, "stream": True, "max_tokens": 200, "ignore_eos": True}
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=10) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            next(lines)
            scheduler.stop()
            started = time.monotonic()
            events = [line for line in lines if line]
            assert time.monotonic() - started < 3  # the 1 s migration wait, then the error
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == "migration_failed" and "--migration-wait 1s" in error["message"], error
        assert not INTERNAL.search(events[-2]), events[-2]

        # Nothing in flight: an unreachable replica is still a prompt 503.
        response = httpx.post(f"{gw.url}/v1/chat/completions", json=CHAT, timeout=10)
        assert_error(response, 503, code="scheduler_unavailable", error_type="service_unavailable_error")
        assert_retryable_and_internal_free(response)
        assert httpx.get(f"{gw.url}/health").status_code == 503

        scheduler.start()
        assert httpx.get(f"{gw.url}/health").status_code == 200
        before = len(fake.requests)
        with ThreadPoolExecutor(1) as pool:  # a non-streaming request in flight when it dies again
            pending = pool.submit(httpx.post, f"{gw.url}/v1/chat/completions",
                                  json={**CHAT, "max_tokens": 200, "ignore_eos": True}, timeout=10)
            wait_until(lambda: len(fake.requests) > before, what="the request to reach the scheduler")
            time.sleep(0.2)
            scheduler.stop()
            assert_error(pending.result(), 503, code="migration_failed", error_type="service_unavailable_error",
                         message_has=("no replica was ready",))
            assert_retryable_and_internal_free(pending.result())
        scheduler.start()
        response = httpx.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "max_tokens": 3}, timeout=10)
        assert response.status_code == 200, response.text


def test_engine_fault_is_migrated_and_else_a_500(smollm2_dir: str) -> None:
    """A request the engine failed (not the client's fault) is never a 400: it is re-submitted,
    and when migration is off it is a 500 (an UNAVAILABLE replica: 503)."""
    failing = FakeScheduler(reject=lambda request: "engine step failed: worker died", reject_kind=pb.ENGINE_FAULT)
    with FakeSchedulerServer(failing) as bad, FakeSchedulerServer() as good, \
            BackgroundGateway(f"{bad.address},{good.address}", smollm2_dir) as gw:
        for _ in range(3):  # whichever replica a request starts on, it ends on the good one
            response = httpx.post(f"{gw.url}/v1/completions", json={**COMPLETION, "max_tokens": 4}, timeout=10)
            assert response.status_code == 200, response.text
        assert failing.requests, "no request was routed to the failing replica"
    with FakeSchedulerServer(failing) as bad, BackgroundGateway(bad.address, smollm2_dir) as gw:
        failing.requests.clear()
        response = httpx.post(f"{gw.url}/v1/completions", json=COMPLETION, timeout=10)
        assert_error(response, 503, code="migration_failed", error_type="service_unavailable_error",
                     message_has=("failed 4 times", "--max-migrations 3"))
        assert_retryable_and_internal_free(response)
        assert "worker died" not in response.text  # the engine's own account is the server log's
        assert [r.request_id.rsplit("-", 1)[-1] for r in failing.requests] == ["0", "m1", "m2", "m3"]
    for kind, status, code in ((pb.ENGINE_FAULT, 500, "engine_fault"), (pb.UNAVAILABLE, 503, "engine_unavailable"),
                               (pb.ERROR_KIND_UNSPECIFIED, 500, "engine_fault")):
        failing = FakeScheduler(reject=lambda request: "no worker", reject_kind=kind)
        options = GatewayOptions(migration=MigrationPolicy(max_migrations=0))
        with FakeSchedulerServer(failing) as bad, BackgroundGateway(bad.address, smollm2_dir, options=options) as gw:
            response = httpx.post(f"{gw.url}/v1/completions", json=COMPLETION, timeout=10)
            error_type = "server_error" if status == 500 else "service_unavailable_error"
            assert_error(response, status, code=code, error_type=error_type, message_has=("The engine ",))
            assert "no worker" not in response.text  # the engine's own account is the server log's
            assert ("retry-after" in response.headers) is (status == 503)
    # A full waiting queue is backpressure: a 429 at once, with migration on, and not re-submitted.
    full = FakeScheduler(reject=lambda request: "the scheduler's waiting queue is full",
                         reject_kind=pb.RESOURCE_EXHAUSTED)
    with FakeSchedulerServer(full) as busy, BackgroundGateway(busy.address, smollm2_dir) as gw:
        response = httpx.post(f"{gw.url}/v1/completions", json=COMPLETION, timeout=10)
        assert_error(response, 429, code="engine_queue_full", error_type="rate_limit_error",
                     message_has=("waiting queue is full",))
        assert len(full.requests) == 1


def _streamed_text(sse: str) -> str:
    """The content of a chat SSE stream (fails on an in-band error event)."""
    text = []
    for line in sse.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            text += [c["delta"].get("content") or "" for c in event["choices"]]
    return "".join(text)


# ---------------------------------------------------------------------- server


def test_port_in_use_is_a_clear_error(smollm2_dir: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"cannot listen on 127.0.0.1:{port} \\(port already in use\\)"):
            bind_socket("127.0.0.1", port)
        with pytest.raises(PortInUseError):
            serve_gateway("127.0.0.1", port, "127.0.0.1:1", smollm2_dir)


def test_the_gateways_connections_send_small_writes_at_once(smollm2_dir: str) -> None:
    """TCP_NODELAY on every accepted connection: with Nagle's algorithm a stream's first event
    waited behind the response headers for the client's (delayed) ACK, ~40 ms at Linux's
    default, on every request sent right after another one (bench serve, concurrency 1)."""
    with FakeSchedulerServer(FakeScheduler()) as scheduler, BackgroundGateway(scheduler.address, smollm2_dir) as gw, \
            httpx.Client() as client:
        assert client.get(f"{gw.url}/health").status_code == 200  # the connection stays open (keep-alive)
        connections = list(gw._server.server_state.connections)
        assert connections
        for protocol in connections:
            sock = protocol.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
