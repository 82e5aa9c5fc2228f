"""The real mesh against the offline engine, through the official `openai` client."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from mesh import Mesh
from openai import AsyncOpenAI, OpenAI

from services.sdk import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def mesh():
    m = Mesh()
    yield m
    assert m.stop() == 0, "serve did not stop cleanly on Ctrl-C"


@pytest.fixture(scope="module")
def offline(smollm2_dir):
    return LLM(smollm2_dir)


@pytest.fixture(scope="module")
def client(mesh):
    return OpenAI(base_url=f"{mesh.base_url}/v1", api_key="none")


def _model(client: OpenAI) -> str:
    return client.models.list().data[0].id


def test_serve_banner_shows_url_and_curl(mesh):
    text = "".join(mesh.banner)
    assert f"http://localhost:{mesh.port}/v1" in text
    assert "curl " in text and "/chat/completions" in text


def test_chat_greedy_equals_offline_chat_and_stream_concatenates(client, offline):
    expected = offline.chat(QUESTION, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    reply = client.chat.completions.create(model=_model(client), messages=QUESTION, temperature=0, max_tokens=40)
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.completion_tokens == len(expected.token_ids)
    stream = client.chat.completions.create(model=_model(client), messages=QUESTION, temperature=0, max_tokens=40,
                                            stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == expected.text


def test_completions_greedy_equals_offline_generate(client, offline):
    prompt = "The three primary colours are"
    expected = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    reply = client.completions.create(model=_model(client), prompt=prompt, temperature=0, max_tokens=24)
    assert reply.choices[0].text == expected.text
    stream = client.completions.create(model=_model(client), prompt=prompt, temperature=0, max_tokens=24,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected.text


def test_32_concurrent_streaming_clients_get_the_right_text(mesh, offline):
    prompts = [f"Count from {i} to {i + 5}:" for i in range(32)]
    sp = SamplingParams(temperature=0, max_tokens=16)
    expected = [o.outputs[0].text for o in offline.generate(prompts, sp, use_tqdm=False)]

    async def one(client: AsyncOpenAI, model: str, prompt: str) -> str:
        stream = await client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=16,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main() -> list[str]:
        client = AsyncOpenAI(base_url=f"{mesh.base_url}/v1", api_key="none", max_retries=0)
        model = (await client.models.list()).data[0].id
        return await asyncio.gather(*(one(client, model, p) for p in prompts))

    assert asyncio.run(main()) == expected


def test_disconnect_mid_stream_aborts_and_frees_blocks(mesh, client):
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{mesh.base_url}/v1/chat/completions",
                         json={"model": _model(client), "messages": QUESTION, "max_tokens": 2000,
                               "ignore_eos": True, "stream": True}) as resp:
            assert resp.status_code == 200
            chunks = 0
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    chunks += 1
                if chunks >= 3:
                    break  # leave with the request still generating
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = mesh.metrics()
        if m.get("myvllm:num_requests_running") == 0 and m.get("myvllm:kv_cache_usage_perc") == 0:
            break
        time.sleep(0.2)
    m = mesh.metrics()
    assert m["myvllm:num_requests_running"] == 0
    assert m["myvllm:num_requests_waiting"] == 0
    assert m["myvllm:kv_cache_usage_perc"] == 0
