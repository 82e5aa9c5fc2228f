"""Property-based fuzzing of request bodies (hypothesis): whatever a client sends to the
generation routes, the gateway answers promptly, never with a 5xx, and every error is in
OpenAI's shape. The gateway runs in front of the fake scheduler (see test_gateway_errors)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from support.fake_scheduler import FakeScheduler, FakeSchedulerServer

from services.gateway.server import BackgroundGateway

MODEL = "SmolLM2-135M-Instruct"

# Any JSON value, NaN and out-of-range integers included.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=8)
small_ints = st.integers(-3, 300)
token_ids = st.lists(st.integers(-5, 60000), min_size=0, max_size=12)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "robot"]) | json_values},
    optional={"content": st.text(max_size=40) | json_values, "name": st.text(max_size=5)}), max_size=3)

# Plausible values for each field (to get past the first check), or anything at all.
FIELDS = {
    "model": st.sampled_from([MODEL, "gpt-17"]),
    "prompt": st.text(max_size=40) | token_ids | st.lists(st.text(max_size=10), max_size=3) | st.lists(token_ids,
                                                                                                        max_size=2),
    "messages": messages,
    "max_tokens": small_ints, "max_completion_tokens": small_ints, "min_tokens": small_ints,
    "n": st.integers(-1, 130), "seed": st.integers(-(2**64), 2**64),
    "temperature": st.floats(-1, 3) | st.just(float("nan")), "top_p": st.floats(-0.5, 1.5), "top_k": small_ints,
    "min_p": st.floats(-1, 2), "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3),
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=5), "stop_token_ids": token_ids,
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logprobs": st.booleans() | small_ints, "top_logprobs": small_ints, "prompt_logprobs": small_ints,
    "echo": st.booleans(), "ignore_eos": st.booleans(), "logit_bias": st.dictionaries(
        st.text(max_size=6), st.floats(-200, 200), max_size=3),
    "bad_words": st.lists(st.text(max_size=6), max_size=3), "priority": small_ints, "cache_salt": st.text(max_size=6),
    "tools": json_values, "response_format": json_values, "suffix": json_values, "user": json_values,
    # vLLM's fields.
    "allowed_token_ids": token_ids, "truncate_prompt_tokens": small_ints,
    "truncation_side": st.sampled_from(["left", "right"]), "request_id": st.text(max_size=8),
    "return_token_ids": st.booleans(), "return_tokens_as_token_ids": st.booleans(),
    "use_beam_search": st.booleans(), "guided_choice": st.lists(st.text(max_size=4), max_size=3),
    "guided_json": json_values, "reasoning_effort": st.sampled_from(["low", "none", "max"]),
    "documents": json_values, "vllm_xargs": json_values, "add_special_tokens": st.booleans(),
}
# Anything in any field: exercises the first checks.
wild_bodies = st.fixed_dictionaries({}, optional={name: values | json_values for name, values in FIELDS.items()})
# A valid request for either route plus a few plausible fields: gets deep (sampling, the engine).
deep_bodies = st.builds(
    lambda prompt, extra: {"model": MODEL, "prompt": prompt, "messages": [{"role": "user", "content": prompt}],
                           "max_tokens": 4, **extra},
    st.text(min_size=1, max_size=20),
    st.lists(st.sampled_from(sorted(FIELDS)), max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: FIELDS[name] for name in names})))
bodies = wild_bodies | deep_bodies


@pytest.fixture(scope="module")
def http(smollm2_dir: str) -> Iterator[httpx.Client]:
    with FakeSchedulerServer(FakeScheduler(max_model_len=256)) as scheduler, \
            BackgroundGateway(scheduler.address, smollm2_dir) as gateway, \
            httpx.Client(base_url=gateway.url, timeout=10) as client:
        yield client


def _assert_well_answered(response: httpx.Response) -> None:
    event(f"HTTP {response.status_code}")
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    else:
        assert "server_error" not in response.text, response.text  # nor an in-band one in a stream


SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                              HealthCheck.too_slow])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@SETTINGS
@given(body=bodies)
def test_no_body_is_a_5xx_or_a_hang(http: httpx.Client, path: str, body: dict) -> None:
    # httpx's timeout turns a hang into a failure; NaN goes out as the JSON extension token.
    _assert_well_answered(http.post(path, content=json.dumps(body), headers={"content-type": "application/json"}))


@SETTINGS
@given(raw=st.binary(max_size=64) | json_values.map(json.dumps))
def test_no_raw_payload_is_a_5xx_or_a_hang(http: httpx.Client, raw: bytes | str) -> None:
    _assert_well_answered(http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}))
