"""vLLM's frontend flags through the gateway's FastAPI app (a real uvicorn server in front of the
fake scheduler): CORS, --root-path, --max-logprobs, --response-role, several --api-key and
--served-model-name values, --generation-config defaults, --tokenizer, --enable-log-requests."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.fake_scheduler import FakeScheduler, FakeSchedulerServer

from services.gateway.cors import CorsSettings
from services.gateway.options import GatewayOptions
from services.gateway.request_defaults import generation_config_defaults
from services.gateway.request_log import REQUEST_LOGGER
from services.gateway.server import BackgroundGateway

KEYS = ("first-key-0123456789", "second-key-0123456789")
AUTH = {"Authorization": f"Bearer {KEYS[1]}"}
ORIGIN = "https://app.example"
GENERATION_CONFIG = {"temperature": 0.25, "top_k": 7, "top_p": 0.5, "repetition_penalty": 1.25,
                     "max_new_tokens": 5, "eos_token_id": 2}
CHAT = {"model": "b", "messages": [{"role": "user", "content": "Say hello"}]}


@pytest.fixture(scope="module")
def model_dir(smollm2_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A model directory without a tokenizer (--tokenizer supplies it) and with sampling defaults
    in its generation_config.json."""
    directory = tmp_path_factory.mktemp("model")
    os.symlink(Path(smollm2_dir) / "config.json", directory / "config.json")
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return str(directory)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def gw(model_dir: str, smollm2_dir: str) -> Iterator[tuple[BackgroundGateway, FakeScheduler, Records]]:
    options = GatewayOptions(api_key=KEYS, tokenizer=smollm2_dir, cors=CorsSettings(allowed_origins=(ORIGIN,)),
                             root_path="/api", max_logprobs=2, response_role="bot", enable_log_requests=True,
                             uvicorn_log_level="error", disable_uvicorn_access_log=True)
    records = Records()
    logging.getLogger(REQUEST_LOGGER).addHandler(records)
    fake = FakeScheduler(script=[100, 101, 2], eos_token_id=2, max_model_len=512)
    try:
        with FakeSchedulerServer(fake) as scheduler, BackgroundGateway(scheduler.address, model_dir, ["a", "b"],
                                                                       options=options) as gateway:
            yield gateway, fake, records
    finally:
        logging.getLogger(REQUEST_LOGGER).removeHandler(records)


@pytest.fixture(scope="module")
def plain(smollm2_dir: str) -> Iterator[BackgroundGateway]:
    """vLLM's defaults (and --generation-config vllm)."""
    with FakeSchedulerServer() as scheduler, BackgroundGateway(
            scheduler.address, smollm2_dir, options=GatewayOptions(generation_config="vllm")) as gateway:
        gateway.fake = scheduler.servicer
        yield gateway


def post(gateway: BackgroundGateway, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{gateway.url}{path}", json=body, headers=AUTH if headers is None else headers, timeout=30)


def test_any_of_several_api_keys_is_accepted(gw) -> None:
    gateway, _, _ = gw
    for key in KEYS:
        assert httpx.get(f"{gateway.url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert httpx.get(f"{gateway.url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_several_served_names_are_listed_accepted_and_the_first_reported(gw) -> None:
    gateway, _, _ = gw
    assert [m["id"] for m in httpx.get(f"{gateway.url}/v1/models", headers=AUTH).json()["data"]] == ["a", "b"]
    assert httpx.get(f"{gateway.url}/v1/models/b", headers=AUTH).json()["id"] == "b"
    response = post(gateway, "/v1/chat/completions", CHAT)
    assert response.status_code == 200 and response.json()["model"] == "a"
    assert post(gateway, "/v1/chat/completions", {**CHAT, "model": "c"}).status_code == 404


def test_generation_config_defaults_fill_what_a_request_leaves_unset(gw) -> None:
    gateway, fake, _ = gw
    fake.requests.clear()
    assert post(gateway, "/v1/chat/completions", CHAT).status_code == 200
    assert post(gateway, "/v1/chat/completions", {**CHAT, "temperature": 0, "top_k": -1, "max_tokens": 3}
                ).status_code == 200
    unset, given = (r.sampling for r in fake.requests)
    assert (unset.temperature, unset.top_k, unset.top_p, unset.repetition_penalty, unset.max_tokens) == \
        pytest.approx((0.25, 7, 0.5, 1.25, 5))
    assert (given.temperature, given.top_k, given.top_p, given.max_tokens) == pytest.approx((0, -1, 0.5, 3))


def test_generation_config_vllm_applies_none(plain) -> None:
    plain.fake.requests.clear()
    response = post(plain, "/v1/chat/completions", {**CHAT, "model": "SmolLM2-135M-Instruct"}, headers={})
    assert response.status_code == 200
    (request,) = plain.fake.requests
    assert (request.sampling.temperature, request.sampling.HasField("max_tokens")) == (1.0, False)
    assert generation_config_defaults("vllm", "/anywhere") == {}


def test_generation_config_dir_reads_that_directory(model_dir: str, tmp_path: Path) -> None:
    assert generation_config_defaults(model_dir, str(tmp_path))["max_tokens"] == 5
    assert generation_config_defaults("auto", str(tmp_path)) == {}  # a model without one: none
    with pytest.raises(ValueError, match="--generation-config"):
        generation_config_defaults(str(tmp_path), "/m")


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/completions", {"model": "a", "prompt": "hi", "logprobs": 3}, "logprobs"),
    ("/v1/completions", {"model": "a", "prompt": "hi", "prompt_logprobs": 3}, "prompt_logprobs"),
])
def test_more_logprobs_than_max_logprobs_is_a_400_naming_the_flag(gw, path: str, body: dict, param: str) -> None:
    gateway, _, _ = gw
    response = post(gateway, path, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert "--max-logprobs" in error["message"] and error["param"] == param
    assert post(gateway, path, {**body, param: 2}).status_code == 200


def test_response_role_names_the_reply_when_the_prompt_asks_for_one(gw) -> None:
    gateway, _, _ = gw
    assert post(gateway, "/v1/chat/completions", CHAT).json()["choices"][0]["message"]["role"] == "bot"
    continued = post(gateway, "/v1/chat/completions", {**CHAT, "add_generation_prompt": False})
    assert continued.json()["choices"][0]["message"]["role"] == "assistant"
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH,
                      timeout=30) as stream:
        first = next(line for line in stream.iter_lines() if line.startswith("data: "))
    assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["role"] == "bot"


def test_cors_answers_a_preflight_for_an_allowed_origin_only(gw, plain) -> None:
    gateway, _, _ = gw
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    allowed = httpx.options(f"{gateway.url}/v1/chat/completions", headers={"Origin": ORIGIN, **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{gateway.url}/v1/chat/completions", headers={"Origin": "https://evil.example",
                                                                          **preflight})
    assert "access-control-allow-origin" not in other.headers
    refused = httpx.get(f"{gateway.url}/v1/models", headers={"Origin": ORIGIN})  # a 401 a page can read
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN
    anywhere = httpx.get(f"{plain.url}/v1/models", headers={"Origin": "https://any.example"})  # vLLM's default: *
    assert anywhere.headers["access-control-allow-origin"] == "*"


def test_root_path_is_reported_and_the_api_served_with_or_without_it(gw) -> None:
    gateway, _, _ = gw
    assert httpx.get(f"{gateway.url}/openapi.json").json()["servers"] == [{"url": "/api"}]
    for prefix in ("", "/api"):
        assert httpx.get(f"{gateway.url}{prefix}/v1/models", headers=AUTH).json()["data"][0]["id"] == "a"
        # the prefix does not step around the API key
        assert httpx.get(f"{gateway.url}{prefix}/v1/models").status_code == 401


def test_uvicorn_log_level_and_access_log(gw, plain) -> None:
    gateway, _, _ = gw
    assert (gateway._server.config.log_level, gateway._server.config.access_log) == ("error", False)
    assert (plain._server.config.log_level, plain._server.config.access_log) == ("info", True)  # vLLM's default


def test_each_request_is_logged_with_its_params(gw) -> None:
    gateway, _, records = gw
    records.lines.clear()
    assert post(gateway, "/v1/completions", {"model": "a", "prompt": "hi", "max_tokens": 2}).status_code == 200
    (line,) = [r for r in records.lines if r.startswith("Received request cmpl-")]
    assert "max_tokens=2" in line


def test_options_refuse_a_missing_tokenizer_and_an_out_of_range_max_logprobs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--tokenizer"):
        GatewayOptions(tokenizer=str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="--max-logprobs"):
        GatewayOptions(max_logprobs=21)
