"""The gateway's limits and credentials: 429 with Retry-After beyond the concurrency limit and
its queue, 401 without the API key, OpenAI's bounds on n and logprobs, n > 1 seeds."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from fake_scheduler import FakeScheduler, FakeSchedulerServer, wait_until
from test_gateway_errors import COMPLETION, MODEL, assert_error

from services.gateway.admission import AdmissionController
from services.gateway.options import GatewayOptions
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
        assert httpx.get(f"{gw.url}/v1/models").status_code == 200  # only generation is limited
        fake.running.set()
        assert running.result().status_code == 200 and queued.result().status_code == 200
        assert len(fake.requests) == 2  # the refused one never reached the engine
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
