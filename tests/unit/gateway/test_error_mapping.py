"""The gateway's error mapping (services/gateway/errors.py), the one place engine failures become
client errors: what the client reads (a JSON body, an SSE error event, Anthropic's shape) names no
internal address, port or gRPC status text; a retryable one carries Retry-After; the server's log
has the whole story."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest
from support.processes import free_port

from services.client.grpc_client import AsyncClient, RequestRejected, SchedulerUnavailable
from services.common.proto import myvllm_pb2 as pb
from services.gateway.errors import RETRY_AFTER_S, OpenAIError, as_openai_error, error_body, error_response
from services.gateway.migration import MigrationFailed

INTERNAL = re.compile(r"\d+\.\d+\.\d+\.\d+|:\d+|UNAVAILABLE|StatusCode|DEADLINE_EXCEEDED|failed to connect|"
                      r"Connection refused|ipv4:|worker at|scheduler at")
WORKER_DOWN = ("replica unavailable: worker at 127.0.0.1:50061 is unreachable (UNAVAILABLE: failed to connect to "
               "all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50061: Failed to connect to remote host: "
               "Connection refused)")


def unreachable_scheduler_error() -> tuple[SchedulerUnavailable, str]:
    """What the real scheduler client raises for a scheduler port where nothing listens."""
    address = f"127.0.0.1:{free_port()}"

    async def ask() -> None:
        client = AsyncClient(address, timeout=2.0)
        try:
            await client.get_stats()
        finally:
            await client.close()

    with pytest.raises(SchedulerUnavailable) as caught:
        asyncio.run(ask())
    return caught.value, address


def client_texts(error: OpenAIError) -> list[str]:
    """Everything a client can read of `error`: the OpenAI body (also the SSE error event's
    payload), Anthropic's body, and the HTTP response's body and headers."""
    response = error_response(error, "/v1/chat/completions")
    return [json.dumps(error.to_dict()), json.dumps(error_body(error, "/v1/messages")), response.body.decode(),
            json.dumps(dict(response.headers))]


def assert_names_no_internals(error: OpenAIError) -> None:
    for text in client_texts(error):
        assert not INTERNAL.search(text), text


def test_an_unreachable_scheduler_is_a_503_that_names_no_address(caplog: pytest.LogCaptureFixture) -> None:
    unreachable, address = unreachable_scheduler_error()
    assert address in str(unreachable) and "UNAVAILABLE" in str(unreachable)  # what must not reach the client
    with caplog.at_level(logging.WARNING, logger="services.gateway.errors"):
        error = as_openai_error(unreachable)
    assert (error.status_code, error.type, error.code) == (503, "service_unavailable_error", "scheduler_unavailable")
    assert error.message == "The engine is unavailable; retry later"
    assert_names_no_internals(error)
    assert error_response(error).headers["retry-after"] == str(RETRY_AFTER_S)
    assert json.loads(error_response(error, "/v1/messages").body)["error"]["type"] == "overloaded_error"
    assert address in caplog.text and "UNAVAILABLE" in caplog.text  # the operator still learns where and why


@pytest.mark.parametrize(("kind", "status", "code", "retry_after"), [
    (pb.UNAVAILABLE, 503, "engine_unavailable", True),
    (pb.ENGINE_FAULT, 500, "engine_fault", False),
    (pb.ERROR_KIND_UNSPECIFIED, 500, "engine_fault", False),
])
def test_an_engine_failure_is_our_own_message_and_logged(caplog: pytest.LogCaptureFixture, kind: int, status: int,
                                                          code: str, retry_after: bool) -> None:
    with caplog.at_level(logging.WARNING, logger="services.gateway.errors"):
        error = as_openai_error(RequestRejected("cmpl-1-0", WORKER_DOWN, kind))
    assert (error.status_code, error.code) == (status, code)
    assert error.type == ("server_error" if status == 500 else "service_unavailable_error")
    assert_names_no_internals(error)
    assert ("retry-after" in error_response(error).headers) is retry_after
    assert WORKER_DOWN in caplog.text and "cmpl-1-0" in caplog.text


def test_the_clients_own_mistakes_keep_the_engines_words() -> None:
    """A 400 (the request itself) and a 429 (a full queue) are about the client's request: the
    engine's text, which names no address, goes through."""
    invalid = as_openai_error(RequestRejected("r", "prompt needs more KV blocks than exist", pb.INVALID_REQUEST))
    assert (invalid.status_code, invalid.message) == (400, "prompt needs more KV blocks than exist")
    assert "retry-after" not in error_response(invalid).headers
    full = as_openai_error(RequestRejected("r", "the scheduler's waiting queue is full", pb.RESOURCE_EXHAUSTED))
    assert full.status_code == 429 and full.message.endswith("the scheduler's waiting queue is full")
    assert error_response(full).headers["retry-after"] == str(RETRY_AFTER_S)


def test_a_failed_migration_tells_how_and_logs_what_failed(caplog: pytest.LogCaptureFixture) -> None:
    unreachable, address = unreachable_scheduler_error()
    try:
        raise MigrationFailed("request cmpl-2-0 lost its engine replica and no replica was ready within "
                              "--migration-wait 1s") from unreachable
    except MigrationFailed as e:
        failed = e
    with caplog.at_level(logging.WARNING, logger="services.gateway.errors"):
        error = as_openai_error(failed)
    assert (error.status_code, error.code) == (503, "migration_failed")
    assert "--migration-wait 1s" in error.message
    assert_names_no_internals(error)
    assert error_response(error).headers["retry-after"] == str(RETRY_AFTER_S)
    assert "cmpl-2-0" in caplog.text and address in caplog.text


def test_an_unexpected_exception_is_a_500_naming_only_its_type(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="services.gateway.errors"):
        error = as_openai_error(ConnectionError("connecting to 10.0.0.3:5000 failed"))
    assert (error.status_code, error.message) == (500, "Internal server error: ConnectionError")
    assert_names_no_internals(error)
    assert "10.0.0.3:5000" in caplog.text
