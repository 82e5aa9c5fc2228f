"""The gateway's LoRA interface, vLLM's: --lora-modules (both forms), a request naming an adapter
in `model` (its LoRARequest reaches the engine; prefix routing keyed by it), /v1/models with each
adapter's parent, runtime load/unload behind VLLM_ALLOW_RUNTIME_LORA_UPDATING and the API key,
from --lora-root only, and vLLM's lora_requests_info gauge. A real uvicorn gateway in front of
the fake scheduler."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from support.fake_scheduler import FakeScheduler, FakeSchedulerServer

from services.common.block_hash import adapter_key, block_hashes
from services.common.lora_adapter_config import CONFIG_FILE, WEIGHTS_FILE
from services.common.proto import myvllm_pb2 as pb
from services.gateway.lora_registry import (
    RUNTIME_UPDATES_ENV,
    LoraModule,
    LoraRegistry,
    lora_int_id,
    parse_lora_module,
)
from services.gateway.migration import ResumableRequest
from services.gateway.options import GatewayOptions
from services.gateway.routing import RoutePrompt
from services.gateway.server import BackgroundGateway

MODEL = "SmolLM2-135M-Instruct"
KEY = "lora-test-key-0123456789"


def _adapter(path: Path, rank: int = 8) -> str:
    path.mkdir(parents=True)
    (path / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 16,
                                                 "target_modules": ["q_proj", "v_proj"]}))
    (path / WEIGHTS_FILE).write_bytes(b"")
    return str(path)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-root")
    outside = tmp_path_factory.mktemp("elsewhere")
    return {"root": str(root), "ada": _adapter(root / "ada"), "adb": _adapter(root / "adb"),
            "too_big": _adapter(root / "big", rank=64), "outside": _adapter(outside / "x")}


@pytest.fixture(scope="module")
def stack(smollm2_dir: str, adapters: dict[str, str]) -> Iterator[tuple[FakeScheduler, BackgroundGateway]]:
    fake = FakeScheduler(script=[100, 101, 2], eos_token_id=2, max_model_len=512, max_lora=2)
    options = GatewayOptions(api_key=KEY, lora_root=adapters["root"],
                             lora_modules=(parse_lora_module(f"ada={adapters['ada']}"),))
    previous = os.environ.get(RUNTIME_UPDATES_ENV)
    os.environ[RUNTIME_UPDATES_ENV] = "true"
    try:
        with FakeSchedulerServer(fake) as scheduler, BackgroundGateway(scheduler.address, smollm2_dir,
                                                                       options=options) as gateway:
            yield fake, gateway
    finally:
        os.environ.pop(RUNTIME_UPDATES_ENV) if previous is None else os.environ.update({RUNTIME_UPDATES_ENV: previous})


def _client(gateway: BackgroundGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY)


def _post(gateway: BackgroundGateway, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{gateway.url}{path}", json=body, headers=headers, timeout=30)


def test_a_request_naming_an_adapter_runs_with_it_and_the_base_without(stack, adapters) -> None:
    fake, gateway = stack
    client = _client(gateway)
    chunks = list(client.chat.completions.create(model="ada", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, stream=True))
    assert chunks and fake.requests[-1].HasField("lora_request")
    lora = fake.requests[-1].lora_request
    real = os.path.realpath(adapters["ada"])
    assert (lora.lora_name, lora.lora_path, lora.lora_int_id) == ("ada", real, lora_int_id("ada", real))
    reply = client.completions.create(model="ada", prompt="hello", max_tokens=2)
    assert fake.requests[-1].lora_request.lora_name == "ada" and reply.model == "ada"  # (vLLM reports the adapter)
    assert chunks[0].model == "ada"
    client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    assert not fake.requests[-1].HasField("lora_request")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="embeddings"):  # never the base model's, silently
        client.embeddings.create(model="ada", input="hello")


def test_models_lists_each_adapter_with_its_parent(stack, adapters) -> None:
    _, gateway = stack
    cards = {m.id: m for m in _client(gateway).models.list().data}
    assert cards["ada"].parent == MODEL and cards["ada"].root == os.path.realpath(adapters["ada"])
    assert getattr(cards[MODEL], "parent", None) is None


def test_runtime_load_and_unload_follow_vllm(stack, adapters) -> None:
    _, gateway = stack
    body = {"lora_name": "adb", "lora_path": adapters["adb"]}
    assert _post(gateway, "/v1/load_lora_adapter", body, key=None).status_code == 401
    assert _post(gateway, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": adapters["outside"]}
                 ).status_code == 400
    escaping = os.path.join(adapters["root"], "..", os.path.basename(os.path.dirname(adapters["outside"])), "x")
    assert _post(gateway, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": escaping}).status_code == 400
    too_big = _post(gateway, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": adapters["too_big"]})
    assert too_big.status_code == 400 and "max-lora-rank" in too_big.json()["error"]["message"]
    loaded = _post(gateway, "/v1/load_lora_adapter", body)
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    assert _post(gateway, "/v1/load_lora_adapter", body).status_code == 400  # the name is taken
    client = _client(gateway)
    client.completions.create(model="adb", prompt="hello", max_tokens=2)
    assert "adb" in {m.id for m in client.models.list().data}
    assert _post(gateway, "/v1/unload_lora_adapter", {"lora_name": "adb"}).status_code == 200
    assert _post(gateway, "/v1/unload_lora_adapter", {"lora_name": "adb"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="adb", prompt="hello", max_tokens=2)


def test_metrics_carry_vllms_lora_requests_info(stack) -> None:
    _, gateway = stack
    _client(gateway).completions.create(model="ada", prompt="hello", max_tokens=2)
    text = httpx.get(f"{gateway.url}/metrics", timeout=30).text
    line = next(line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters="ada' in line


def test_without_the_switch_the_runtime_routes_do_not_exist(smollm2_dir: str, adapters,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUNTIME_UPDATES_ENV, raising=False)
    with FakeSchedulerServer(FakeScheduler(max_lora=2)) as scheduler, \
            BackgroundGateway(scheduler.address, smollm2_dir, options=GatewayOptions(lora_root=adapters["root"])) as gw:
        response = _post(gw, "/v1/load_lora_adapter", {"lora_name": "adb", "lora_path": adapters["adb"]}, key=None)
        assert response.status_code == 404


def test_module_forms_and_start_up_refusals(adapters) -> None:
    assert parse_lora_module("a=/p") == LoraModule("a", "/p")
    assert parse_lora_module('{"name": "a", "path": "/p", "base_model_name": "m"}') == LoraModule("a", "/p", "m")
    for bad in ("a", "=p", '{"name": 1}'):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)
    with pytest.raises(ValueError, match="--lora-modules big: .*max-lora-rank"):
        LoraRegistry([LoraModule("big", adapters["too_big"])], max_lora_rank=16)
    registry = LoraRegistry([LoraModule("ada", adapters["ada"], "base")])
    assert registry.parents["ada"] == "base"
    with pytest.raises(Exception, match="--lora-root"):
        registry.add_at_runtime("x", adapters["adb"], 16)  # no root given: runtime loads refused


def test_prefix_routing_hashes_an_adapters_prompt_apart() -> None:
    """A request's routing hashes are keyed by its adapter's name and id as the scheduler keys its
    blocks (tests/unit/engine/test_lora_scheduling.py checks that side against block_hashes)."""
    tokens = list(range(100))
    lora = pb.LoRARequest(lora_name="ada", lora_int_id=7, lora_path="/a")
    routed = ResumableRequest("r", tokens, pb.SamplingParams(), cache_salt="s", lora_request=lora).route_prompt()
    assert routed.hashes(16) == block_hashes(tokens[:96], 16, "s", adapter_key("ada", 7))
    assert routed.hashes(16) != RoutePrompt(tokens, "s").hashes(16)
