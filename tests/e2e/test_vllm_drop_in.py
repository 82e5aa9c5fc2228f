"""`myvllm serve` as a drop-in for `vllm serve`: a vLLM user's command line starts it, and a vLLM
client's requests (the official `openai` client with vLLM's fields in extra_body, and plain
HTTP) get vLLM's answers: each vLLM request field is taken with its meaning where it is
observable, the ones we lack are a 400 naming the field, the API keys guard /v1, both served
names answer, and /metrics has vLLM's series. One serve for the whole file."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.mesh import Mesh

from services.entrypoints.bench.lora_adapters import write_random_adapters

# The command line as a vLLM user types it (vLLM's spellings: half, 4k, several names and keys).
VLLM_COMMAND = ("models/SmolLM2-135M-Instruct --dtype half --max-model-len 4k --enable-prefix-caching "
                "--generation-config auto --uvicorn-log-level info --served-model-name a b --api-key k1 k2").split()
KEY, MODEL = "k2", "b"
MESSAGES = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Two random PEFT adapters of the model: one served from the start, one loaded at runtime."""
    return write_random_adapters("models/SmolLM2-135M-Instruct", str(tmp_path_factory.mktemp("loras")), num=2)


@pytest.fixture(scope="module")
def serve(adapters: list[str]):
    lora = ["--enable-lora", "--max-lora-rank", "16", "--lora-modules", f"ada={adapters[0]}",
            "--lora-root", os.path.dirname(adapters[0])]
    mesh = Mesh(VLLM_COMMAND + lora, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    yield mesh
    assert mesh.stop() == 0, "serve did not stop cleanly on Ctrl-C"


@pytest.fixture(scope="module")
def client(serve: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{serve.base_url}/v1", api_key=KEY, max_retries=0)


def _chat(client: openai.OpenAI, max_tokens: int = 4, **extra_body):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens,
                                          temperature=0, extra_body=extra_body)


def _post(serve: Mesh, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{serve.base_url}{path}", json={"model": MODEL, **body}, headers=headers, timeout=120)


def test_short_api_keys_are_taken_with_one_warning_and_half_is_float16(serve: Mesh) -> None:
    """vLLM's CPU backend runs float16 as asked (x86 and Arm have it); so does the worker."""
    warnings = [line for line in serve.output if "--api-key / $MYVLLM_API_KEY" in line]
    assert len(warnings) == 1, warnings
    assert "(key 1) is shorter than 16 bytes" in warnings[0] and "(key 2) is shorter" in warnings[0]
    assert "k1" not in warnings[0] and "k2" not in warnings[0]
    assert any("dtype float16 on cpu" in line for line in serve.output), "".join(serve.output)[-3000:]


@pytest.mark.parametrize("field", [
    {"use_beam_search": False}, {"reasoning_effort": "low"}, {"length_penalty": 1.0},
    {"documents": [{"title": "Sky", "text": "The sky is blue."}]}, {"mm_processor_kwargs": {}},
    {"vllm_xargs": {"my_extension": 1}}, {"an_unknown_key": {"x": 1}},
], ids=lambda field: next(iter(field)))
def test_fields_without_an_observable_effect_are_taken(client: openai.OpenAI, field: dict) -> None:
    reply = _chat(client, **field)
    assert reply.choices[0].message.content is not None and reply.usage.completion_tokens >= 1


def test_request_id_names_the_response(client: openai.OpenAI) -> None:
    assert _chat(client, request_id="drop-in-1").id == "chatcmpl-drop-in-1"


def test_truncate_prompt_tokens_keeps_that_many(client: openai.OpenAI) -> None:
    assert _chat(client, truncate_prompt_tokens=5).usage.prompt_tokens == 5


def test_return_token_ids_and_allowed_token_ids(client: openai.OpenAI) -> None:
    allowed = [330, 331, 332]
    reply = _chat(client, max_tokens=3, return_token_ids=True, allowed_token_ids=allowed)
    assert reply.model_extra["prompt_token_ids"] and len(reply.model_extra["prompt_token_ids"]) == \
        reply.usage.prompt_tokens
    token_ids = reply.choices[0].model_extra["token_ids"]
    assert token_ids and set(token_ids) <= set(allowed), token_ids


def test_return_tokens_as_token_ids(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0,
                                           logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    assert all(entry.token.startswith("token_id:") for entry in reply.choices[0].logprobs.content)


def test_echo_prepends_the_prompt_on_completions(client: openai.OpenAI) -> None:
    prompt = "The sky is"
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True)
    assert completion.choices[0].text.startswith(prompt) and len(completion.choices[0].text) > len(prompt)
    assert _chat(client, echo=True).choices[0].message.content is not None  # chat takes it too


@pytest.mark.parametrize(("field", "value", "answers"), [
    ("guided_choice", ["yes", "no"], {"yes", "no"}),
    ("guided_regex", "(red|green)", {"red", "green"}),
    ("guided_grammar", 'root ::= "alpha" | "beta"', {"alpha", "beta"}),
])
def test_guided_fields_constrain_the_answer(client: openai.OpenAI, field: str, value: object,
                                            answers: set[str]) -> None:
    assert _chat(client, max_tokens=8, **{field: value}).choices[0].message.content in answers


def test_guided_json_starts_an_object_of_the_schema(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"]}
    content = _chat(client, max_tokens=16, guided_json=schema).choices[0].message.content
    assert content.lstrip().startswith("{")
    if content.rstrip().endswith("}"):  # (complete within max_tokens: the schema's)
        assert json.loads(content)["answer"] in ("yes", "no")


@pytest.mark.parametrize(("field", "value"), [("use_beam_search", True), ("mm_processor_kwargs", {"size": 1})])
def test_what_we_lack_is_a_400_naming_the_field(serve: Mesh, field: str, value: object) -> None:
    response = _post(serve, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, field: value})
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]


def test_either_key_is_needed(serve: Mesh) -> None:
    body = {"messages": MESSAGES, "max_tokens": 2}
    assert _post(serve, "/v1/chat/completions", body, key=None).status_code == 401
    assert _post(serve, "/v1/chat/completions", body, key="k3").status_code == 401
    assert _post(serve, "/v1/chat/completions", body, key="k1").status_code == 200


def test_both_served_names_answer(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["a", "b", "ada"]
    reply = client.chat.completions.create(model="a", messages=MESSAGES, max_tokens=2)
    assert reply.model == "a" and reply.choices[0].message.content is not None


def test_metrics_has_vllms_series(serve: Mesh, client: openai.OpenAI) -> None:
    _chat(client)
    samples = {(sample.name, frozenset(sample.labels.items())): sample.value for family in
               text_string_to_metric_families(httpx.get(f"{serve.base_url}/metrics", timeout=10).text)
               for sample in family.samples}

    def value(name: str, **labels: str) -> float | None:
        return samples.get((name, frozenset({"model_name": "a", "engine": "0", **labels}.items())))

    assert value("vllm:num_requests_waiting") == 0 and value("vllm:num_requests_running") is not None
    assert value("vllm:num_requests_waiting_by_reason", reason="capacity") == 0
    assert value("vllm:request_success_total", finished_reason="length") >= 1
    assert value("vllm:engine_sleep_state", sleep_state="awake") == 1
    assert value("vllm:request_num_preemptions_count") >= 1
    assert value("vllm:prompt_tokens_total") > 0 and value("vllm:generation_tokens_total") > 0
    info = [dict(labels) for name, labels in samples if name == "vllm:cache_config_info"]
    assert info and info[0]["enable_prefix_caching"] == "True"


def test_lora_adapters_stream_and_load_at_runtime(serve: Mesh, client: openai.OpenAI, adapters: list[str]) -> None:
    """vLLM's LoRA serving: an adapter named in `model` streams its own greedy text (not the base
    model's); /v1/models shows it with its parent; one more is loaded and unloaded at runtime
    (with the key only)."""
    def greedy(model: str) -> str:
        stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0,
                                                stream=True)
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    base, adapted = greedy(MODEL), greedy("ada")
    assert adapted and adapted != base and greedy("ada") == adapted
    card = next(m for m in client.models.list().data if m.id == "ada")
    assert card.parent == "a"
    body = {"lora_name": "adb", "lora_path": adapters[1]}
    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{serve.base_url}/v1/load_lora_adapter", json=body, timeout=60).status_code == 401
    assert httpx.post(f"{serve.base_url}/v1/load_lora_adapter", json=body, headers=headers,
                      timeout=60).status_code == 200
    second = greedy("adb")
    assert second and second not in (base, adapted)
    assert httpx.post(f"{serve.base_url}/v1/unload_lora_adapter", json={"lora_name": "adb"}, headers=headers,
                      timeout=60).status_code == 200
    with pytest.raises(openai.NotFoundError):
        greedy("adb")
