"""Unit tests: a stream whose engine request fails ends in-band, never by a dropped connection
or a stream that waits forever.

- the SSE guard (services/gateway/sse.py) turns any exception that gets past a writer, a stray
  CancelledError included, into the API's error event + [DONE], over real HTTP framing (an
  ASGI app under httpx), while a cancellation of the response task itself still propagates;
- a CancelledError raised from below (gRPC raises one in a call whose channel is closed under
  it) is an engine failure: the request migrates and stays token-exact; the SDK's unary calls
  report it as `SchedulerUnavailable` (a real channel, closed under a real call);
- a choice task that ends that way still tells the merged stream it ended.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
import httpx
import pytest
from fastapi import FastAPI

from services.client.grpc_client import AsyncClient
from services.common.proto import myvllm_pb2 as pb
from services.common.proto import myvllm_pb2_grpc as pb_grpc
from services.gateway.generation import ChoiceRequest, _merge_choices, _Run
from services.gateway.metrics import GatewayMetrics
from services.gateway.migration import MigrationPolicy, ResumableRequest, resumable_outputs
from services.gateway.router import ReplicaRouter
from services.gateway.routing import RoutePrompt
from services.gateway.sse import DONE, guarded_events, sse_event, sse_response


async def _writer(failure: BaseException, after_done: bool = False) -> AsyncIterator[str]:
    yield sse_event({"text": "one"})
    if after_done:
        yield DONE
    raise failure


async def _collect(events: AsyncIterator[str]) -> list[str]:
    return [event async for event in events]


@pytest.mark.parametrize("failure", [RuntimeError("boom"), asyncio.CancelledError()])
def test_guard_ends_a_failed_stream_with_an_error_event_and_done(failure: BaseException) -> None:
    events = asyncio.run(_collect(guarded_events(_writer(failure))))
    assert events[0] == sse_event({"text": "one"})
    assert events[-1] == DONE and len(events) == 3
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and error["message"].startswith("Internal server error")


def test_guard_adds_nothing_after_done_and_uses_the_apis_own_error_events() -> None:
    events = asyncio.run(_collect(guarded_events(_writer(RuntimeError("late"), after_done=True))))
    assert events == [sse_event({"text": "one"}), DONE]
    events = asyncio.run(_collect(guarded_events(_writer(RuntimeError("x")), on_error=lambda e: [f"event: {e}\n\n"])))
    assert events == [sse_event({"text": "one"}), "event: x\n\n"]


def test_guard_lets_a_cancellation_of_its_own_task_through() -> None:
    closed = []

    async def slow() -> AsyncIterator[str]:
        try:
            yield sse_event({"text": "one"})
            await asyncio.sleep(60)
            yield sse_event({"text": "never"})
        finally:
            closed.append(True)

    async def main() -> list[str]:
        got: list[str] = []

        async def consume() -> None:
            async for event in guarded_events(slow()):
                got.append(event)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return got

    assert asyncio.run(main()) == [sse_event({"text": "one"})]
    assert closed == [True]  # the writer was closed (its engine requests aborted), not left open


def test_a_failing_stream_over_http_completes_its_response() -> None:
    """Without the guard the exception reaches the server, which can only cut the connection
    (httpx then raises mid-body); with it the body is complete and ends in-band."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> object:
        return sse_response(_writer(asyncio.CancelledError()))

    async def main() -> str:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            response = await client.post("/v1/completions")
            return response.text

    body = asyncio.run(main())
    assert body.startswith(sse_event({"text": "one"})) and body.endswith(DONE)
    assert '"error"' in body


class _ChannelClosedUnderCall:
    """A replica client whose first attempt loses its call the way gRPC reports a channel
    closed under it (a CancelledError in the caller); the next attempt finishes the request."""

    def __init__(self) -> None:
        self.attempts: list[tuple[str, list[int]]] = []

    async def generate(self, prompt_token_ids: list[int], sampling: pb.SamplingParams, request_id: str,
                       resumed_output_token_ids: list[int], **_: object) -> AsyncGenerator[pb.RequestOutput, None]:
        self.attempts.append((request_id, list(resumed_output_token_ids)))
        if len(self.attempts) == 1:
            yield pb.RequestOutput(request_id=request_id, new_token_ids=[11, 12])
            raise asyncio.CancelledError()
        yield pb.RequestOutput(request_id=request_id, new_token_ids=[13], finish_reason="length")

    async def connect(self) -> None:
        pass

    async def health(self) -> bool:
        return True

    async def abort(self, request_ids: list[str]) -> None:
        pass


def test_a_call_cancelled_from_below_migrates_token_exact() -> None:
    async def main() -> tuple[list[int], ResumableRequest, ReplicaRouter, _ChannelClosedUnderCall]:
        router = ReplicaRouter(["127.0.0.1:1"])
        replica = router.replicas["127.0.0.1:1"]
        fake = _ChannelClosedUnderCall()
        replica.client = fake
        request = ResumableRequest("cmpl-x-0", [1, 2, 3], pb.SamplingParams(max_tokens=3))
        tokens = [t async for out in resumable_outputs(router, request, replica, MigrationPolicy(poll_interval_s=0.01))
                  for t in out.new_token_ids]
        return tokens, request, router, fake

    tokens, request, router, fake = asyncio.run(main())
    assert tokens == [11, 12, 13]
    assert request.num_migrations == 1
    assert fake.attempts == [("cmpl-x-0", []), ("cmpl-x-0-m1", [11, 12])]
    # Marked down when its call broke, up again once it answered ready (a single replica has no
    # load updates to say so).
    assert router.replicas["127.0.0.1:1"].healthy


def test_a_unary_call_whose_channel_is_closed_under_it_reports_the_scheduler_unavailable() -> None:
    """A real gRPC server whose Health never answers keeps the call in flight until its channel closes."""
    class SlowScheduler(pb_grpc.SchedulerServicer):
        async def Health(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
            await asyncio.sleep(60)
            return pb.HealthResponse(ok=True)

    async def main() -> tuple[bool, float]:
        server = grpc.aio.server()
        pb_grpc.add_SchedulerServicer_to_server(SlowScheduler(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = AsyncClient(f"127.0.0.1:{port}", timeout=30)
        started = time.monotonic()
        health = asyncio.create_task(client.health())
        await asyncio.sleep(0.5)
        assert not health.done()
        await client._channel.close()  # what _reset_channel's retiring close does after its grace
        answer = await health  # a CancelledError here would end the caller's task as if it were cancelled
        await client.close()
        await server.stop(None)
        return answer, time.monotonic() - started

    answer, took = asyncio.run(main())
    assert answer is False and took < 10


def test_a_choice_that_dies_from_below_ends_the_merged_stream_with_an_error() -> None:
    class DyingProcessor:
        def process(self, output: pb.RequestOutput) -> object:
            raise asyncio.CancelledError()  # not a cancellation of the choice's task

    async def main() -> BaseException:
        router = ReplicaRouter(["127.0.0.1:1"])
        replica = router.replicas["127.0.0.1:1"]
        replica.client = _ChannelClosedUnderCall()
        engine = ResumableRequest("cmpl-y-0", [1, 2, 3], pb.SamplingParams(max_tokens=3))
        run = _Run(router, replica, GatewayMetrics("m"), MigrationPolicy(), time.monotonic(), RoutePrompt([1, 2, 3]),
                   0, replica.load_ts)
        merged = _merge_choices(run, [ChoiceRequest(engine, DyingProcessor())])
        with pytest.raises(RuntimeError) as raised:
            await asyncio.wait_for(anext(merged), 10)  # (before: waited for that choice forever)
        await merged.aclose()
        return raised.value

    assert "cancelled from below" in str(asyncio.run(main()))
