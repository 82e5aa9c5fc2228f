"""The OpenAI API of the gateway, driven by the official `openai` client against a
real uvicorn server in front of the fake scheduler."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from support.fake_scheduler import FakeScheduler, FakeSchedulerServer, wait_until

from services.gateway.options import GatewayOptions
from services.gateway.server import BackgroundGateway
from services.text.tokenizer import Tokenizer

MODEL = "SmolLM2-135M-Instruct"  # the served name: the model directory's basename
# An output cut by max_tokens inside a character ends without its U+FFFD (the incomplete
# bytes are held back, as vLLM does): the expected text is decode()'s without it.
CUT = "\ufffd"
MAX_MODEL_LEN = 512
EOS = 2  # <|im_end|>
REPLY = "Hello 世界 🎉! How are you today?"
MESSAGES = [{"role": "user", "content": "Say hello"}]


@dataclass
class Stack:
    scheduler: FakeSchedulerServer
    gateway: BackgroundGateway
    tokenizer: Tokenizer
    reply_ids: list[int]

    @property
    def fake(self) -> FakeScheduler:
        return self.scheduler.servicer

    def chat_prompt_ids(self, messages: list[dict] = MESSAGES) -> list[int]:
        text = self.tokenizer.render_chat(messages)
        return self.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def stack(smollm2_dir: str) -> Iterator[Stack]:
    tokenizer = Tokenizer.load(smollm2_dir)
    reply_ids = tokenizer.encode(REPLY, add_special_tokens=False)
    fake = FakeScheduler(script=reply_ids + [EOS], eos_token_id=EOS, max_model_len=MAX_MODEL_LEN)
    with FakeSchedulerServer(fake) as scheduler, BackgroundGateway(scheduler.address, smollm2_dir) as gw:
        yield Stack(scheduler, gw, tokenizer, reply_ids)


@pytest.fixture(autouse=True)
def fresh_fake(stack: Stack) -> None:
    stack.fake.step_delay_s = 0.001
    stack.fake.fail_after_tokens = 0
    stack.fake.running.set()
    stack.fake.requests.clear()
    stack.fake.aborted.clear()


@pytest.fixture
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway.url}/v1", api_key="x", max_retries=0, timeout=30)


# ---------------------------------------------------------------------- models, health


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_health(stack: Stack) -> None:
    assert httpx.get(f"{stack.gateway.url}/health").status_code == 200


# ---------------------------------------------------------------------- chat


def test_chat_completion(stack: Stack, client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, user="someone")
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == REPLY  # the EOS token's text is not shown
    assert choice.finish_reason == "stop"
    assert response.object == "chat.completion" and response.model == MODEL
    prompt_ids = stack.chat_prompt_ids()
    assert list(stack.fake.requests[0].prompt_token_ids) == prompt_ids
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(stack.reply_ids) + 1  # EOS counts
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_chat_default_max_tokens_is_left_to_the_engine(stack: Stack, client: openai.OpenAI) -> None:
    """No max_tokens: the request goes without one, and the engine gives it the rest of the
    context (vLLM's default, computed there alone: tests/test_engine_core.py)."""
    client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert not stack.fake.requests[0].sampling.HasField("max_tokens")


def test_chat_max_completion_tokens_wins_over_max_tokens(stack: Stack, client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=7,
                                              max_completion_tokens=3)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 3
    assert response.choices[0].message.content == stack.tokenizer.decode(stack.reply_ids[:3]).removesuffix(CUT)


def test_chat_stream(stack: Stack, client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == REPLY
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == len(stack.reply_ids) + 1
    assert usage_chunk.usage.prompt_tokens == len(stack.chat_prompt_ids())
    # Never a broken character on the wire, even though the reply splits 世, 界 and 🎉 over tokens.
    assert not any("\ufffd" in (c.choices[0].delta.content or "") for c in chunks if c.choices)


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(stack: Stack, client: openai.OpenAI) -> None:
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk's usage counts
    the tokens so far; the last chunk's is the total."""
    chat = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    completion = list(client.completions.create(
        model=MODEL, prompt="a", stream=True, max_tokens=32,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    for chunks, prompt_tokens in ((chat, len(stack.chat_prompt_ids())), (completion, None)):
        assert all(c.usage is not None for c in chunks)
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == len(stack.reply_ids) + 1 and counts[0] < counts[-1]
        assert len({c.usage.prompt_tokens for c in chunks}) == 1
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
        if prompt_tokens is not None:
            assert chunks[0].usage.prompt_tokens == prompt_tokens
    # Without include_usage it asks for nothing (vLLM's rule): no chunk carries usage.
    plain = list(client.completions.create(model=MODEL, prompt="a", stream=True, max_tokens=4,
                                           stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)


def test_sse_framing_is_exactly_openais(stack: Stack) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "max_tokens": 4}
    with httpx.stream("POST", f"{stack.gateway.url}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        json.loads(event[len("data: "):])
    first = json.loads(events[0][len("data: "):])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = json.loads(events[-3][len("data: "):])
    assert last["choices"][0]["finish_reason"] == "length"
    assert "usage" not in last or last["usage"] is None


def test_chat_n_fans_out(stack: Stack, client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, max_tokens=2)
    assert [c.index for c in response.choices] == [0, 1, 2]
    ids = [r.request_id for r in stack.fake.requests]
    assert sorted(i.rsplit("-", 1)[1] for i in ids) == ["0", "1", "2"]
    assert ids[0].startswith(response.id)
    assert response.usage.completion_tokens == 6
    assert response.usage.prompt_tokens == len(stack.chat_prompt_ids())  # counted once per prompt


def test_chat_stream_n(client: openai.OpenAI) -> None:
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: REPLY, 1: REPLY}


def test_chat_logprobs(stack: Stack, client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2,
                                              max_tokens=5)
    assert stack.fake.requests[0].sampling.logprobs == 2
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    assert [entry.token for entry in content] == [stack.tokenizer.token_text(t) for t in stack.reply_ids[:5]]
    # Raw token bytes rebuild the exact UTF-8 text, even where a token holds half of "世".
    joined = b"".join(bytes(entry.bytes) for entry in content)
    assert joined == REPLY.encode()[:len(joined)] and len(joined) == len("Hello 世".encode()) + 1
    assert all(len(entry.top_logprobs) == 2 and entry.logprob == -0.25 for entry in content)


def test_chat_logprobs_streaming(client: openai.OpenAI) -> None:
    entries = []
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, max_tokens=6,
                                                stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            entries += chunk.choices[0].logprobs.content
    assert len(entries) == 6 and all(e.top_logprobs == [] for e in entries)


def test_stop_string_spanning_tokens_truncates_and_aborts(stack: Stack, client: openai.OpenAI) -> None:
    # "w a" spans the tokens " How" and " are".
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, stop=["w a", "zzz"])
    choice = response.choices[0]
    assert choice.message.content == "Hello 世界 🎉! Ho"
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == "w a"
    wait_until(lambda: stack.fake.aborted == [stack.fake.requests[0].request_id], what="abort after stop string")


def test_stop_string_streaming(stack: Stack, client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stop="w a", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello 世界 🎉! Ho"
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_until(lambda: len(stack.fake.aborted) == 1, what="abort after stop string")


def test_include_stop_str_in_output(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, stop=["w a"],
                                              extra_body={"include_stop_str_in_output": True})
    assert response.choices[0].message.content == "Hello 世界 🎉! How a"


def test_eos_text_shown_only_when_asked(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES,
        extra_body={"include_stop_str_in_output": True, "skip_special_tokens": False})
    assert response.choices[0].message.content == REPLY + "<|im_end|>"


def test_stop_token_ids(stack: Stack, client: openai.OpenAI) -> None:
    bang = stack.tokenizer.encode("!", add_special_tokens=False)[0]
    assert bang in stack.reply_ids
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"stop_token_ids": [bang]})
    assert response.choices[0].message.content == "Hello 世界 🎉"  # the stop token's text is hidden
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].model_extra["stop_reason"] == bang


def test_sampling_parameters_reach_the_scheduler(stack: Stack, client: openai.OpenAI) -> None:
    client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0.5, top_p=0.9, seed=7, frequency_penalty=0.5,
        presence_penalty=-0.5, logit_bias={"100": 5}, max_tokens=9, user="u",
        extra_body={"top_k": 40, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 2, "ignore_eos": True,
                    "stop_token_ids": [5], "bad_words": ["hello"], "priority": 4, "cache_salt": "s1"})
    request = stack.fake.requests[0]
    sampling = request.sampling
    assert sampling.temperature == pytest.approx(0.5) and sampling.top_p == pytest.approx(0.9)
    assert (sampling.top_k, sampling.seed, sampling.max_tokens, sampling.min_tokens) == (40, 7, 9, 2)
    assert sampling.min_p == pytest.approx(0.1) and sampling.repetition_penalty == pytest.approx(1.2)
    assert sampling.frequency_penalty == pytest.approx(0.5) and sampling.presence_penalty == pytest.approx(-0.5)
    assert dict(sampling.logit_bias) == {100: 5.0}
    assert sampling.ignore_eos and list(sampling.stop_token_ids) == [5]
    assert [list(w.ids) for w in sampling.bad_words] == stack.tokenizer.bad_words_token_ids(["hello"])
    assert sampling.logprobs == -1
    assert (request.priority, request.cache_salt) == (4, "s1")


def test_concurrent_streams_with_async_client(stack: Stack) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"request {i}"}], stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{stack.gateway.url}/v1", api_key="x", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(8)))

    assert asyncio.run(main()) == [REPLY] * 8


# ---------------------------------------------------------------------- completions


def test_completion_with_string_prompt(stack: Stack, client: openai.OpenAI) -> None:
    response = client.completions.create(model=MODEL, prompt="Once upon a time")
    assert response.choices[0].finish_reason == "length"  # the 16-token default cut the reply
    assert stack.fake.requests[0].sampling.max_tokens == 16  # OpenAI's and vLLM's default for completions
    response = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=32)
    assert response.object == "text_completion"
    assert response.choices[0].text == REPLY and response.choices[0].finish_reason == "stop"
    prompt_ids = stack.tokenizer.encode("Once upon a time")
    assert list(stack.fake.requests[0].prompt_token_ids) == prompt_ids
    assert response.usage.prompt_tokens == len(prompt_ids)


@pytest.mark.parametrize("prompt", [["first prompt", "second"], [[1, 2, 3], [4, 5]]])
def test_completion_with_several_prompts_and_n(stack: Stack, client: openai.OpenAI, prompt: list) -> None:
    response = client.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=3)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert all(c.text == stack.tokenizer.decode(stack.reply_ids[:3]).removesuffix(CUT) for c in response.choices)
    prompts_sent = sorted((r.request_id.rsplit("-", 1)[1], list(r.prompt_token_ids)) for r in stack.fake.requests)
    prompt_ids = [stack.tokenizer.encode(p) if isinstance(p, str) else p for p in prompt]
    assert prompts_sent == [("0", prompt_ids[0]), ("1", prompt_ids[0]), ("2", prompt_ids[1]), ("3", prompt_ids[1])]
    assert response.usage.prompt_tokens == len(prompt_ids[0]) + len(prompt_ids[1])
    assert response.usage.completion_tokens == 12


def test_completion_null_max_tokens_is_left_to_the_engine_for_each_prompt(stack: Stack) -> None:
    """A null max_tokens goes unset with every prompt (the engine gives each the rest of its
    context); a prompt that leaves no room is still a 400 from the gateway."""
    body = {"model": MODEL, "prompt": [[7] * 10, [7] * 100], "max_tokens": None}
    assert httpx.post(f"{stack.gateway.url}/v1/completions", json=body).status_code == 200
    assert sorted(len(r.prompt_token_ids) for r in stack.fake.requests) == [10, 100]
    assert not any(r.sampling.HasField("max_tokens") for r in stack.fake.requests)
    full = httpx.post(f"{stack.gateway.url}/v1/completions",
                      json={**body, "prompt": [[7] * MAX_MODEL_LEN]})
    assert full.status_code == 400 and full.json()["error"]["code"] == "context_length_exceeded"


def test_completion_with_token_prompt_and_echo(stack: Stack, client: openai.OpenAI) -> None:
    prompt_ids = stack.tokenizer.encode("Echo me: ")
    response = client.completions.create(model=MODEL, prompt=prompt_ids, echo=True, max_tokens=5)
    assert response.choices[0].text == stack.tokenizer.decode(prompt_ids) + stack.tokenizer.decode(
        stack.reply_ids[:5]).removesuffix(CUT)


def test_completion_stream(stack: Stack, client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt=["a", "b"], stream=True, echo=True, max_tokens=32,
                                            stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {0: "a" + REPLY, 1: "b" + REPLY}
    assert finishes == {0: "stop", 1: "stop"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * (len(stack.reply_ids) + 1)


def test_completion_logprobs(stack: Stack, client: openai.OpenAI) -> None:
    response = client.completions.create(model=MODEL, prompt="x", logprobs=3, max_tokens=4)
    logprobs = response.choices[0].logprobs
    expected_tokens = [stack.tokenizer.token_text(t) for t in stack.reply_ids[:4]]
    assert logprobs.tokens == expected_tokens
    assert logprobs.token_logprobs == [-0.25] * 4
    # Top 3 plus the sampled token, keyed by text (so partial characters, all "\ufffd", may collide).
    assert all(1 <= len(top) <= 4 and top[tok] == -0.25 for top, tok in zip(logprobs.top_logprobs, expected_tokens,
                                                                             strict=True))
    assert len(logprobs.top_logprobs[0]) == 3  # "Hello" is the top-1 itself
    offsets = [0]
    for token in expected_tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets


def test_completion_logprobs_streaming_offsets_continue(stack: Stack, client: openai.OpenAI) -> None:
    offsets, tokens = [], []
    for chunk in client.completions.create(model=MODEL, prompt="x", logprobs=0, max_tokens=6, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            offsets += chunk.choices[0].logprobs.text_offset
            tokens += chunk.choices[0].logprobs.tokens
    assert len(tokens) == 6
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(6)]


def test_completion_stop_string(stack: Stack, client: openai.OpenAI) -> None:
    response = client.completions.create(model=MODEL, prompt="x", stop=["🎉"])
    assert response.choices[0].text == "Hello 世界 "
    assert response.choices[0].finish_reason == "stop"
    wait_until(lambda: len(stack.fake.aborted) == 1, what="abort after stop string")


# ---------------------------------------------------------------------- vLLM's request fields


def _post(stack: Stack, path: str, body: dict) -> dict:
    response = httpx.post(f"{stack.gateway.url}{path}", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_vllm_fields_that_change_nothing_here_are_accepted(stack: Stack) -> None:
    """Beam-search knobs at their defaults, render-only flags and hints: a 200, and the engine
    gets exactly what it gets without them."""
    plain = {"messages": MESSAGES, "max_tokens": 3}
    no_ops = {"use_beam_search": False, "length_penalty": 1.3, "mm_processor_kwargs": {}, "media_io_kwargs": {},
              "session_id": "s", "stream_interval": 4, "return_token_offsets": True, "return_mm_kwargs": False,
              "routed_experts_prompt_start": 2, "include_reasoning": False, "watermarking": False, "best_of": 1,
              "thinking_token_budget": -1, "guided_decoding_backend": "xgrammar", "logits_processors": [],
              "kv_transfer_params": None, "vllm_xargs": {"my_ext": [1, "a"]}}
    for body in (plain, {**plain, **no_ops}):
        assert _post(stack, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    assert stack.fake.requests[0].sampling == stack.fake.requests[1].sampling
    assert stack.fake.requests[0].prompt_token_ids == stack.fake.requests[1].prompt_token_ids
    completion = {"prompt": "a", "max_tokens": 3, "use_beam_search": False, "length_penalty": 1.0, "best_of": 1}
    assert _post(stack, "/v1/completions", completion)["choices"][0]["text"]


def test_request_id_names_the_response_and_the_engine_requests(stack: Stack, client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, n=2,
                                              extra_body={"request_id": "my-req-1"})
    assert response.id == "chatcmpl-my-req-1"  # vLLM's prefix
    engine_ids = [r.request_id for r in stack.fake.requests]
    assert len(set(engine_ids)) == 2 and all(i.startswith("chatcmpl-my-req-1-") for i in engine_ids)
    completion = client.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_body={"request_id": "c7"})
    assert completion.id == "cmpl-c7" and stack.fake.requests[-1].request_id.startswith("cmpl-c7-")

    async def same_id_twice() -> list[str]:  # a reused id is the client's business: both are served
        async with openai.AsyncOpenAI(base_url=f"{stack.gateway.url}/v1", api_key="x", max_retries=0) as aclient:
            replies = await asyncio.gather(*(aclient.chat.completions.create(
                model=MODEL, messages=MESSAGES, extra_body={"request_id": "dup"}) for _ in range(2)))
        return [r.choices[0].message.content for r in replies]

    stack.fake.step_delay_s = 0.01
    assert asyncio.run(same_id_twice()) == [REPLY, REPLY]


def test_truncate_prompt_tokens_keeps_the_last_tokens(stack: Stack) -> None:
    prompt_ids = stack.tokenizer.encode("Once upon a time there was")
    for body, kept in (({"truncate_prompt_tokens": 3}, prompt_ids[-3:]),
                       ({"truncate_prompt_tokens": 3, "truncation_side": "right"}, prompt_ids[:3]),
                       ({"truncate_prompt_tokens": -1}, prompt_ids)):  # -1: up to max_model_len
        for prompt in ("Once upon a time there was", prompt_ids):
            reply = _post(stack, "/v1/completions", {"prompt": prompt, "max_tokens": 2, **body})
            assert list(stack.fake.requests[-1].prompt_token_ids) == kept
            assert reply["usage"]["prompt_tokens"] == len(kept)
    reply = _post(stack, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "truncate_prompt_tokens": 4})
    assert list(stack.fake.requests[-1].prompt_token_ids) == stack.chat_prompt_ids()[-4:]
    assert reply["usage"]["prompt_tokens"] == 4
    # A long prompt cut to fit leaves room for the completion.
    _post(stack, "/v1/completions", {"prompt": [7] * (MAX_MODEL_LEN + 50), "truncate_prompt_tokens": 100})
    assert list(stack.fake.requests[-1].prompt_token_ids) == [7] * 100


def test_allowed_token_ids_restrict_sampling(stack: Stack, client: openai.OpenAI) -> None:
    """The engine's logit bias lifts the allowed tokens by the most it takes (100), every other
    token falls that far behind; the request's own biases among them keep their differences."""
    client.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_body={"allowed_token_ids": [101, 100]})
    assert dict(stack.fake.requests[-1].sampling.logit_bias) == {100: 100.0, 101: 100.0}
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, logit_bias={"100": 5, "7": 50},
                                   extra_body={"allowed_token_ids": [100, 101]})
    assert dict(stack.fake.requests[-1].sampling.logit_bias) == {100: 100.0, 101: 95.0}


def test_return_token_ids(stack: Stack, client: openai.OpenAI) -> None:
    reply_ids = stack.reply_ids + [EOS]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"return_token_ids": True})
    assert chat.model_extra["prompt_token_ids"] == stack.chat_prompt_ids()
    assert chat.choices[0].model_extra["token_ids"] == reply_ids
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                 extra_body={"return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == stack.chat_prompt_ids()
    assert all(c.model_extra.get("prompt_token_ids") is None for c in chunks[1:])
    assert sum((c.choices[0].model_extra["token_ids"] for c in chunks[1:]), []) == reply_ids
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == REPLY
    prompt_ids = stack.tokenizer.encode("Once")
    completion = client.completions.create(model=MODEL, prompt="Once", max_tokens=32,
                                           extra_body={"return_token_ids": True})
    choice = completion.choices[0].model_extra
    assert (choice["prompt_token_ids"], choice["token_ids"]) == (prompt_ids, reply_ids)
    chunks = list(client.completions.create(model=MODEL, prompt="Once", max_tokens=32, stream=True,
                                            extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == prompt_ids
    assert all(c.choices[0].model_extra.get("prompt_token_ids") is None for c in chunks[1:])
    assert sum((c.choices[0].model_extra["token_ids"] for c in chunks), []) == reply_ids
    # Not asked for: OpenAI's shape, without the fields.
    plain = _post(stack, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_return_tokens_as_token_ids(stack: Stack, client: openai.OpenAI) -> None:
    names = [f"token_id:{t}" for t in stack.reply_ids[:3]]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=1,
                                          extra_body={"return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert [e.token for e in content] == names and [e.top_logprobs[0].token for e in content] == names
    assert bytes(content[0].bytes).decode() == names[0]
    completion = client.completions.create(model=MODEL, prompt="a", max_tokens=3, logprobs=1,
                                           extra_body={"return_tokens_as_token_ids": True})
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens == names and all(name in top for name, top in zip(names, logprobs.top_logprobs,
                                                                             strict=True))
    assert logprobs.text_offset == [0, len(names[0]), len(names[0]) + len(names[1])]  # vLLM counts these


def test_chat_echo_prepends_the_last_message(stack: Stack, client: openai.OpenAI) -> None:
    """vLLM's chat echo: the last message's content comes first when the reply continues its
    role (here an assistant turn being continued); a user message last is not echoed."""
    messages = [*MESSAGES, {"role": "assistant", "content": "Sure: "}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True, "echo": True}
    reply = _post(stack, "/v1/chat/completions", body)
    assert reply["choices"][0]["message"]["content"] == "Sure: " + REPLY
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, extra_body={
        "add_generation_prompt": False, "continue_final_message": True, "echo": True}))
    assert chunks[1].choices[0].delta.content == "Sure: "
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Sure: " + REPLY
    plain = _post(stack, "/v1/chat/completions", {"messages": MESSAGES, "echo": True})
    assert plain["choices"][0]["message"]["content"] == REPLY


@pytest.mark.parametrize(("field", "value", "kind"), [
    ("guided_json", {"type": "object", "properties": {"a": {"type": "integer"}}}, "json"),
    ("guided_regex", "[a-z]+", "regex"),
    ("guided_choice", ["yes", "no"], "choice"),
    ("guided_grammar", 'root ::= "a" | "b"', "grammar"),
])
def test_guided_fields_are_structured_outputs(stack: Stack, client: openai.OpenAI, field: str, value: object,
                                              kind: str) -> None:
    """vLLM's older guided_* names constrain the output as structured_outputs does."""
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                   extra_body={field: value, "guided_decoding_backend": "auto"})
    client.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_body={"structured_outputs": {kind: value}})
    via_guided, via_structured = (r.sampling.structured_outputs for r in stack.fake.requests[-2:])
    assert via_guided.WhichOneof("kind") == kind and via_guided == via_structured


def test_reasoning_effort_and_documents_reach_the_chat_template(stack: Stack, smollm2_dir: str) -> None:
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}effort={{ reasoning_effort }} "
                "thinking={{ enable_thinking }}{% for d in documents or [] %} [{{ d.title }}]{% endfor %}|")
    with BackgroundGateway(stack.scheduler.address, smollm2_dir,
                           options=GatewayOptions(chat_template=template)) as gateway:
        def rendered(body: dict) -> str:
            response = httpx.post(f"{gateway.url}/v1/chat/completions",
                                  json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1, **body})
            assert response.status_code == 200, response.text
            return stack.tokenizer.decode(list(stack.fake.requests[-1].prompt_token_ids), skip_special_tokens=False)

        documents = [{"title": "Doc A", "text": "x"}, {"title": "Doc B", "text": "y"}]
        assert "effort=low thinking=True [Doc A] [Doc B]|" in rendered({"reasoning_effort": "low",
                                                                         "documents": documents})
        assert "effort=none thinking=False|" in rendered({"reasoning_effort": "none"})
        # The request's own chat_template_kwargs: reasoning_effort wins over theirs, their enable_thinking stays.
        assert "effort=high thinking=False" in rendered({"reasoning_effort": "high", "chat_template_kwargs": {
            "reasoning_effort": "low", "enable_thinking": False}})
        assert "effort= thinking=|" in rendered({})


def test_add_special_tokens_and_return_prompt_text(stack: Stack) -> None:
    text = stack.tokenizer.render_chat(MESSAGES)
    reply = _post(stack, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "add_special_tokens": True,
                                                  "return_prompt_text": True})
    assert reply["prompt_text"] == text
    assert list(stack.fake.requests[-1].prompt_token_ids) == stack.tokenizer.encode(text, add_special_tokens=True)
    _post(stack, "/v1/completions", {"prompt": "Once", "max_tokens": 2, "add_special_tokens": False})
    assert list(stack.fake.requests[-1].prompt_token_ids) == stack.tokenizer.encode("Once", add_special_tokens=False)


def test_unknown_fields_are_ignored_and_logged(stack: Stack, client: openai.OpenAI,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's answer to a key it does not know: the request runs as if it were absent, and a
    warning names it (a 400 only under --strict-request-fields: test_gateway_errors.py)."""
    with caplog.at_level(logging.WARNING, logger="services.gateway.request_fields"):
        response = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, stream=True,
            stream_options={"include_usage": True, "extra_option": 1},
            extra_body={"frobnicate": {"x": 1}, "some_future_field": True})
        assert list(response)[-1].usage.completion_tokens == 2
        completion = client.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_body={"frob": 1})
        assert completion.choices[0].text
    assert ("The following fields were present in the request but ignored: "
            "{'frobnicate', 'some_future_field', 'stream_options.extra_option'}") in caplog.text
    assert "ignored: {'frob'}" in caplog.text


# ---------------------------------------------------------------------- tokenize


def test_tokenize_and_detokenize(stack: Stack) -> None:
    url = stack.gateway.url
    response = httpx.post(f"{url}/tokenize", json={"prompt": "Hello 世界"}).json()
    assert response == {"tokens": stack.tokenizer.encode("Hello 世界"), "count": len(stack.tokenizer.encode(
        "Hello 世界")), "max_model_len": MAX_MODEL_LEN}
    chat = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES, "model": MODEL}).json()
    assert chat["tokens"] == stack.chat_prompt_ids()
    assert httpx.post(f"{url}/detokenize", json={"tokens": response["tokens"]}).json() == {"prompt": "Hello 世界"}


# ---------------------------------------------------------------------- disconnects


def test_client_disconnect_mid_stream_aborts(stack: Stack) -> None:
    stack.fake.step_delay_s = 0.05
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "max_tokens": 400, "ignore_eos": True}
    with httpx.stream("POST", f"{stack.gateway.url}/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
    wait_until(lambda: stack.fake.aborted == [stack.fake.requests[0].request_id], what="abort after disconnect")


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_while_queued_aborts(stack: Stack, stream: bool) -> None:
    stack.fake.running.clear()  # nothing gets scheduled: the request waits in the queue
    body = {"model": MODEL, "messages": MESSAGES, "stream": stream}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stack.gateway.url}/v1/chat/completions", json=body, timeout=0.5)
    wait_until(lambda: len(stack.fake.aborted) == 1, what="abort after disconnect")


# ---------------------------------------------------------------------- metrics


# vLLM's metric families (as prometheus_client's parser names them) and their types: what a
# dashboard, an autoscaler or a router built for vLLM reads.
VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter", "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:spec_decode_num_drafts": "counter",
    "vllm:spec_decode_num_draft_tokens": "counter", "vllm:spec_decode_num_accepted_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "counter",
    "vllm:request_time_per_output_token_seconds": "histogram", "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram", "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram", "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram", "vllm:time_per_prefill_token_request_seconds": "histogram",
    "vllm:iteration_tokens_total": "histogram", "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram", "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:prompt_tokens_cached": "counter", "vllm:cache_config_info": "gauge",
    "vllm:num_requests_waiting_by_reason": "gauge", "vllm:engine_sleep_state": "gauge",
    "vllm:prompt_tokens_by_source": "counter", "vllm:prompt_tokens_cached_by_source": "counter",
    "vllm:admission_rejections": "counter", "vllm:request_num_preemptions": "histogram",
    "vllm:request_prefill_kv_computed_tokens": "histogram",
}


def _scrape(url: str) -> tuple[dict[str, str], dict[tuple[str, frozenset], float]]:
    """/metrics through prometheus_client's own parser: family types, and every sample's value by
    (sample name, labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    types, samples = {}, {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return types, samples


def test_metrics(stack: Stack, client: openai.OpenAI) -> None:
    _, before = _scrape(stack.gateway.url)
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    types, samples = _scrape(stack.gateway.url)
    ours = {"model_name": MODEL}

    def value(name: str, table: dict = samples, **labels: str) -> float:
        return table.get((name, frozenset({**ours, **labels}.items())), 0.0)

    assert value("myvllm:num_requests_running") == 2
    assert value("myvllm:num_requests_waiting") == 1
    assert value("myvllm:kv_cache_usage_perc") == 0.25
    assert value("myvllm:prefix_cache_queries_total") == 40
    assert value("myvllm:prefix_cache_hits_total") == 10
    assert value("myvllm:num_preemptions_total") == 3
    assert value("myvllm:request_success_total", finished_reason="length") - \
        value("myvllm:request_success_total", before, finished_reason="length") == 1
    assert value("myvllm:prompt_tokens_total") - value("myvllm:prompt_tokens_total", before) == \
        response.usage.prompt_tokens
    assert value("myvllm:generation_tokens_total") - value("myvllm:generation_tokens_total", before) == 3
    # per request: its counts (buckets 1, 2, 5, ... up to the context limit, as vLLM's)
    assert value("myvllm:request_generation_tokens_sum") - value("myvllm:request_generation_tokens_sum", before) == 3
    assert value("myvllm:request_prompt_tokens_sum") - value("myvllm:request_prompt_tokens_sum", before) == \
        response.usage.prompt_tokens
    bounds = sorted(float(dict(labels)["le"]) for name, labels in samples
                    if name == "myvllm:request_prompt_tokens_bucket")
    assert bounds[:4] == [1, 2, 5, 10] and bounds[-2:] == [500, float("inf")]  # (MAX_MODEL_LEN 512)
    assert value("myvllm:request_time_per_output_token_seconds_count") >= 1
    assert value("myvllm:time_to_first_token_seconds_count") >= 1
    assert value("myvllm:inter_token_latency_seconds_count") >= 2
    assert value("myvllm:e2e_request_latency_seconds_bucket", le="+Inf") == \
        value("myvllm:e2e_request_latency_seconds_count") >= 1
    assert types["myvllm:time_to_first_token_seconds"] == "histogram"
    # the engine's account of the request's phases (its final output's timings), once per request
    for name, seconds in (("request_queue_time", 0.25), ("request_prefill_time", 0.5),
                          ("request_decode_time", 1.5), ("request_inference_time", 2.0)):
        assert value(f"myvllm:{name}_seconds_sum") - value(f"myvllm:{name}_seconds_sum", before) == seconds
        assert value(f"myvllm:{name}_seconds_count") - value(f"myvllm:{name}_seconds_count", before) == 1
    assert value("myvllm:time_per_prefill_token_request_seconds_sum") - \
        value("myvllm:time_per_prefill_token_request_seconds_sum", before) == pytest.approx(
            0.5 / response.usage.prompt_tokens)
    # the request's parameters: n = 1, max_tokens = 3; its longest choice: 3 tokens
    assert value("myvllm:request_params_n_bucket", le="1.0") - value("myvllm:request_params_n_bucket", before,
                                                                      le="1.0") == 1
    assert value("myvllm:request_params_max_tokens_sum") - value("myvllm:request_params_max_tokens_sum", before) == 3
    assert value("myvllm:request_max_num_generation_tokens_sum") - \
        value("myvllm:request_max_num_generation_tokens_sum", before) == 3
    # the engine's tokens per step (its Stats' bucket counts: 2 steps of <= 8, 1 of <= 16)
    assert value("myvllm:iteration_tokens_total_bucket", le="8.0") == 2
    assert value("myvllm:iteration_tokens_total_bucket", le="16.0") == 3
    assert value("myvllm:iteration_tokens_total_count") == 3 and value("myvllm:iteration_tokens_total_sum") == 30
    assert value("vllm:cache_config_info", engine="0", block_size="16", cache_dtype="auto",
                 enable_prefix_caching="True", num_gpu_blocks="101") == 1
    # ours alone: what the engine runs (bench serve --base-url reads the dtype there)
    assert value("myvllm:model_config_info", dtype="float32", attention_backend="torch") == 1
    assert "vllm:model_config_info" not in types

    # vLLM's names: each family with vLLM's type, labels model_name and engine, the same values.
    for family, kind in VLLM_FAMILIES.items():
        assert types.get(family) == kind, (family, types.get(family))
    vllm_samples = {(name, labels): v for (name, labels), v in samples.items() if name.startswith("vllm:")}
    # (per draft position: samples only once speculation has run)
    assert {name for name, _ in vllm_samples} >= {f"{f}_total" for f, k in VLLM_FAMILIES.items()
                                                   if k == "counter" and not f.endswith("_per_pos")}
    for (name, labels), v in vllm_samples.items():
        labels = dict(labels)
        frontend = name.startswith("vllm:admission_rejections")  # (vLLM's frontend counter: no engine label)
        assert labels.pop("model_name") == MODEL and (frontend or labels.pop("engine") == "0"), (name, labels)
        assert samples[("my" + name, frozenset({**labels, **ours}.items()))] == v or \
            name.startswith("vllm:request_success"), name
    for reason in ("stop", "length", "abort", "error", "repetition"):  # vLLM's FinishReason values
        assert ("vllm:request_success_total", frozenset({**ours, "engine": "0", "finished_reason": reason}.items())) \
            in samples
    assert value("vllm:request_success_total", engine="0", finished_reason="length") == \
        value("myvllm:request_success_total", finished_reason="length")


# ---------------------------------------------------------------------- migration


@pytest.mark.parametrize("fail_after", [1, 3, 8, 13])  # 3 and 8: inside 世 and 🎉; 13: inside "are you"
def test_text_pipeline_carries_on_across_a_migration(stack: Stack, client: openai.OpenAI, fail_after: int) -> None:
    """The engine fails the request after some tokens (inside a multi-token character, inside a
    stop string): the resumed request's tokens go on through the same detokenizer and stop
    matcher, so the text is exactly the no-fault text."""
    kwargs = dict(model=MODEL, messages=MESSAGES, stop=["are you"], extra_body={"include_stop_str_in_output": False})
    no_fault = client.chat.completions.create(**kwargs).choices[0].message.content
    assert no_fault == "Hello 世界 🎉! How "
    stack.fake.fail_after_tokens = fail_after
    stack.fake.requests.clear()
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(**kwargs, stream=True) if chunk.choices)
    assert streamed == no_fault
    resumed = stack.fake.requests[-1]
    assert list(resumed.resumed_output_token_ids) == stack.reply_ids[:fail_after]
    assert client.chat.completions.create(**kwargs).choices[0].message.content == no_fault
