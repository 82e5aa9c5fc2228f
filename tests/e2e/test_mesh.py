"""The real mesh against the offline engine, through the official `openai` client."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI
from support.mesh import Mesh

from services.offline import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def mesh():
    m = Mesh()
    yield m
    assert m.stop() == 0, "serve did not stop cleanly on Ctrl-C"


@pytest.fixture(scope="module")
def offline(smollm2_dir) -> Iterator[LLM]:
    with LLM(smollm2_dir, dtype="float32") as llm:
        yield llm


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


def test_responses_and_messages_greedy_equal_offline_chat(client, offline, mesh):
    """The Responses and Anthropic Messages APIs run the chat path: through the official clients,
    the same greedy reply as the offline chat, whole and streamed."""
    import anthropic

    expected = offline.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    response = client.responses.create(model=_model(client), input=QUESTION[0]["content"], temperature=0,
                                       max_output_tokens=24)
    assert response.output_text == expected.text and response.usage.output_tokens == len(expected.token_ids)
    with client.responses.stream(model=_model(client), input=QUESTION[0]["content"], temperature=0,
                                 max_output_tokens=24) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
    assert "".join(deltas) == expected.text
    claude = anthropic.Anthropic(base_url=mesh.base_url, api_key="none", max_retries=0)
    message = claude.messages.create(model=_model(client), max_tokens=24, messages=QUESTION,
                                     extra_body={"temperature": 0})
    assert message.content[0].text == expected.text
    assert message.stop_reason == ("max_tokens" if expected.finish_reason == "length" else "end_turn")
    with claude.messages.stream(model=_model(client), max_tokens=24, messages=QUESTION,
                                extra_body={"temperature": 0}) as stream:
        assert "".join(stream.text_stream) == expected.text


def test_prompt_logprobs_through_the_mesh_equal_offline(client, offline, mesh):
    """echo + logprobs (OpenAI) and vLLM's prompt_logprobs field, for completions and chat."""
    prompt = "The three primary colours are"
    ref = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=2),
                           use_tqdm=False)[0]
    ids, expected = ref.prompt_token_ids, ref.prompt_logprobs
    reply = client.completions.create(model=_model(client), prompt=prompt, temperature=0, max_tokens=3, echo=True,
                                      logprobs=2)
    lp = reply.choices[0].logprobs
    assert reply.choices[0].text == prompt + ref.outputs[0].text
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(expected[p][ids[p]].logprob, abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for i, token in enumerate(ref.outputs[0].token_ids):
        assert lp.token_logprobs[len(ids) + i] == pytest.approx(ref.outputs[0].logprobs[i][token].logprob, abs=1e-4)
    # Streaming echo + logprobs: the prompt's entries arrive first.
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=_model(client), prompt=prompt, temperature=0, max_tokens=3, echo=True, logprobs=2, stream=True)
        if c.choices and c.choices[0].logprobs]
    assert sum((c.token_logprobs for c in streamed), []) == lp.token_logprobs

    body = {"model": _model(client), "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 1}
    got = httpx.post(f"{mesh.base_url}/v1/completions", json=body, timeout=60).json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for p in range(1, len(ids)):
        assert got[p][str(ids[p])]["logprob"] == pytest.approx(expected[p][ids[p]].logprob, abs=1e-4)
        assert len(got[p]) in (1, 2)

    chat_ids = offline.apply_chat_template(QUESTION)
    chat_ref = offline.generate({"prompt_token_ids": chat_ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                                use_tqdm=False)[0].prompt_logprobs
    body = {"model": _model(client), "messages": QUESTION, "max_tokens": 1, "prompt_logprobs": 0}
    got = httpx.post(f"{mesh.base_url}/v1/chat/completions", json=body, timeout=60).json()["prompt_logprobs"]
    assert len(got) == len(chat_ids) and got[0] is None
    assert [got[p][str(chat_ids[p])]["logprob"] for p in range(1, len(chat_ids))] == pytest.approx(
        [chat_ref[p][chat_ids[p]].logprob for p in range(1, len(chat_ids))], abs=1e-4)


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


# Generation bounded while fuzzing: any accepted request ends in a few tokens (the default mesh
# would otherwise generate up to the model's whole context for each).
FUZZ_MAX_TOKENS = 4
FUZZ_EXAMPLES_PER_OPERATION = 60


# The field that limits generation on each generating route; every other route generates nothing
# and refuses unknown fields, so nothing is added to its bodies.
_GENERATION_LIMIT_FIELD = {"/v1/completions": "max_tokens", "/v1/chat/completions": "max_tokens",
                           "/v1/messages": "max_tokens", "/v1/responses": "max_output_tokens"}


def _prepare_body(path: str, body: object, model: str) -> None:
    # A generated model name is almost never the served one and the request would end at the 404
    # (tested in test_gateway_errors), so a string name is replaced by the served model's.
    # An absent or null limit means "the rest of the context" (thousands of tokens: minutes on a slow
    # CPU, past the call's deadline), so both are bounded too; a limit of another type is left for the
    # gateway to refuse. Only the route's own field is touched: the gateway rejects unknown fields.
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = model
    field = _GENERATION_LIMIT_FIELD.get(path)
    if field is None:
        return
    for key in (field, "max_completion_tokens"):
        value = body.get(key)
        if value is None and key in body or isinstance(value, (int, float)) and value > FUZZ_MAX_TOKENS:
            body[key] = FUZZ_MAX_TOKENS
    if field not in body and "max_completion_tokens" not in body:
        body[field] = FUZZ_MAX_TOKENS


def test_schemathesis_fuzz_of_every_operation_leaves_the_mesh_healthy_and_idle(mesh):
    """schemathesis generates requests for every operation of the gateway's own /openapi.json
    (valid ones and schema-violating ones) against the real mesh: never a 5xx, never a hang (each
    call has a deadline), and afterwards the mesh is healthy with nothing running and no KV in use."""
    import collections

    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(f"{mesh.base_url}/openapi.json")
    calls: list[str] = []
    served_model = httpx.get(f"{mesh.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=FUZZ_EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def call(case) -> None:
            _prepare_body(case.path, case.body, served_model)
            response = case.call(base_url=mesh.base_url, timeout=60)
            calls.append(f"{case.method} {case.path} {response.status_code}")
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:1000])

        call()
    operations = {c.rsplit(" ", 1)[0] for c in calls}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses", "POST /v1/messages"} <= \
        operations, operations
    print("\n" + "\n".join(f"{k}: {v}" for k, v in sorted(collections.Counter(calls).items())))
    # Valid requests got through (the body preparation above does not make them all invalid); on
    # /v1/completions, whose prompt may be token ids, few generated bodies are valid, so it is not
    # required there.
    for route in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        assert calls.count(f"POST {route} 200") >= 3, route
    assert httpx.get(f"{mesh.base_url}/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 30
    while (m := mesh.metrics())["myvllm:num_requests_running"] or m["myvllm:kv_cache_usage_perc"]:
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    print(f"\nschemathesis: {len(calls)} calls over {len(operations)} operations")


def _readme_sdk_example() -> str:
    """The README's gRPC SDK example, as a newcomer would paste it."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## gRPC SDK"):]
    return section[section.index("```python\n") + len("```python\n"):section.index("```\n", section.index("```python"))]


def test_the_readme_sdk_example_runs_against_serve_unchanged(mesh):
    """`Client()` finds the running serve and its token (the file serve wrote for its user): no
    address, no token in the environment."""
    env = {k: v for k, v in os.environ.items() if k != "MYVLLM_INTERNAL_TOKEN"}
    proc = subprocess.run([sys.executable, "-c", _readme_sdk_example()], cwd=Path(__file__).resolve().parents[2],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].endswith(" length") and "Task was destroyed" not in proc.stderr, proc
    assert "gRPC SDK: services.client.Client() connects to the scheduler" in "".join(mesh.banner)
