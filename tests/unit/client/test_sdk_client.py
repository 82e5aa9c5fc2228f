"""The gRPC SDK against the fake scheduler: streaming, aborts, failures, reconnects."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest
from support.fake_scheduler import FakeScheduler, FakeSchedulerServer, wait_until

from services.client.grpc_client import AsyncClient, Client, RequestRejected, SchedulerUnavailable
from services.common.proto import myvllm_pb2 as pb
from services.common.sampling_params import SamplingParams


@pytest.fixture
def scheduler() -> Iterator[FakeSchedulerServer]:
    reject = lambda request: "prompt is too long" if len(request.prompt_token_ids) > 100 else None  # noqa: E731
    with FakeSchedulerServer(FakeScheduler(script=[10, 11, 12, 13], reject=reject)) as server:
        yield server


def dead_address() -> str:
    """A loopback port nobody listens on."""
    with FakeSchedulerServer() as server:
        address = server.address
    return address


async def collect(client: AsyncClient, **kwargs) -> list[pb.RequestOutput]:
    kwargs.setdefault("prompt_token_ids", [1, 2, 3])
    kwargs.setdefault("sampling_params", SamplingParams(max_tokens=5))
    return [output async for output in client.generate(**kwargs)]


def test_generate_streams_until_finished(scheduler: FakeSchedulerServer) -> None:
    async def main() -> list[pb.RequestOutput]:
        async with AsyncClient(scheduler.address) as client:
            return await collect(client, request_id="r1", priority=3, cache_salt="salt")

    outputs = asyncio.run(main())
    assert [list(o.new_token_ids) for o in outputs] == [[10], [11], [12], [13], [10]]
    assert [o.finish_reason for o in outputs] == ["", "", "", "", "length"]
    sent = scheduler.servicer.requests[0]
    assert (sent.request_id, list(sent.prompt_token_ids)) == ("r1", [1, 2, 3])
    assert (sent.priority, sent.cache_salt) == (3, "salt")
    assert sent.sampling.max_tokens == 5 and sent.sampling.logprobs == -1


def test_accepts_a_proto_sampling_params(scheduler: FakeSchedulerServer) -> None:
    async def main() -> list[pb.RequestOutput]:
        async with AsyncClient(scheduler.address) as client:
            return await collect(client, sampling_params=pb.SamplingParams(max_tokens=2, logprobs=1))

    outputs = asyncio.run(main())
    assert len(outputs) == 2 and len(outputs[0].logprobs) == 1


def test_concurrent_requests_share_one_stream(scheduler: FakeSchedulerServer) -> None:
    async def main() -> list[list[pb.RequestOutput]]:
        async with AsyncClient(scheduler.address) as client:
            return await asyncio.gather(*(collect(client, request_id=f"r{i}") for i in range(20)))

    results = asyncio.run(main())
    assert all(len(outputs) == 5 and outputs[-1].finish_reason == "length" for outputs in results)
    assert {o.request_id for o in results[7]} == {"r7"}
    assert scheduler.servicer.num_streams_opened == 1


def test_breaking_out_of_the_loop_aborts(scheduler: FakeSchedulerServer) -> None:
    async def main() -> None:
        async with AsyncClient(scheduler.address) as client:
            outputs = client.generate([1], SamplingParams(max_tokens=1000), request_id="early")
            async for _ in outputs:
                break
            await outputs.aclose()
            await asyncio.to_thread(wait_until, lambda: scheduler.servicer.aborted == ["early"], 5, "abort")

    asyncio.run(main())


def test_cancelling_the_consumer_aborts(scheduler: FakeSchedulerServer) -> None:
    scheduler.servicer.step_delay_s = 0.05

    async def main() -> None:
        async with AsyncClient(scheduler.address) as client:
            task = asyncio.create_task(collect(client, request_id="cancelled",
                                               sampling_params=SamplingParams(max_tokens=1000)))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.to_thread(wait_until, lambda: scheduler.servicer.aborted == ["cancelled"], 5, "abort")

    asyncio.run(main())


def test_explicit_abort_ends_the_iteration(scheduler: FakeSchedulerServer) -> None:
    scheduler.servicer.step_delay_s = 0.05

    async def main() -> list[pb.RequestOutput]:
        async with AsyncClient(scheduler.address) as client:
            outputs = []
            async for output in client.generate([1], SamplingParams(max_tokens=1000), request_id="a1"):
                outputs.append(output)
                if len(outputs) == 2:
                    await client.abort("a1")
            return outputs

    outputs = asyncio.run(main())
    # (A third real output may have crossed the abort on the wire.)
    assert outputs[-1].finish_reason == "abort" and len(outputs) in (3, 4)
    wait_until(lambda: scheduler.servicer.aborted == ["a1"], what="abort")


def test_rejected_request_raises(scheduler: FakeSchedulerServer) -> None:
    async def main() -> None:
        async with AsyncClient(scheduler.address) as client:
            with pytest.raises(RequestRejected, match="prompt is too long") as info:
                await collect(client, prompt_token_ids=list(range(200)), request_id="big")
            assert info.value.request_id == "big"
            assert info.value.error_kind == pb.INVALID_REQUEST and not info.value.is_engine_failure
            assert len(await collect(client)) == 5  # the stream is still fine

    asyncio.run(main())


def test_engine_failures_carry_their_kind_and_resumed_tokens_reach_the_scheduler(
        scheduler: FakeSchedulerServer) -> None:
    fake = scheduler.servicer

    async def main() -> None:
        async with AsyncClient(scheduler.address) as client:
            fake.reject_kind = pb.ENGINE_FAULT
            with pytest.raises(RequestRejected) as info:
                await collect(client, prompt_token_ids=list(range(200)))
            assert info.value.error_kind == pb.ENGINE_FAULT and info.value.is_engine_failure
            # Resumed after 2 of its 5 tokens: only the other 3 come back.
            outputs = await collect(client, resumed_output_token_ids=[10, 11], request_id="resumed")
            assert [t for o in outputs for t in o.new_token_ids] == [12, 13, 10]
            assert list(fake.requests[-1].resumed_output_token_ids) == [10, 11]

    asyncio.run(main())
    assert RequestRejected("r", "old peer").is_engine_failure  # no kind: an engine fault


def test_duplicate_request_id_is_refused(scheduler: FakeSchedulerServer) -> None:
    scheduler.servicer.step_delay_s = 0.05

    async def main() -> None:
        async with AsyncClient(scheduler.address) as client:
            first = client.generate([1], SamplingParams(max_tokens=100), request_id="dup")
            await anext(first)
            with pytest.raises(ValueError, match="already in flight"):
                await collect(client, request_id="dup")
            await first.aclose()

    asyncio.run(main())


def test_scheduler_death_fails_pending_requests_then_reconnects(scheduler: FakeSchedulerServer) -> None:
    scheduler.servicer.step_delay_s = 0.05

    async def main() -> None:
        async with AsyncClient(scheduler.address) as client:
            outputs = client.generate([1], SamplingParams(max_tokens=1000))
            await anext(outputs)
            await asyncio.to_thread(scheduler.stop)
            started = time.monotonic()
            with pytest.raises(SchedulerUnavailable, match="lost"):
                async for _ in outputs:
                    pass
            assert time.monotonic() - started < 2
            with pytest.raises(SchedulerUnavailable):
                await collect(client)
            assert not await client.health()
            await asyncio.to_thread(scheduler.start)  # same port
            assert len(await collect(client)) == 5
            assert await client.health()

    asyncio.run(main())


def test_unreachable_scheduler_fails_fast() -> None:
    address = dead_address()

    async def main() -> None:
        async with AsyncClient(address) as client:
            started = time.monotonic()
            assert not await client.health()
            with pytest.raises(SchedulerUnavailable, match=address):
                await collect(client)
            with pytest.raises(SchedulerUnavailable):
                await client.get_stats()
            with pytest.raises(SchedulerUnavailable):
                await client.connect()
            assert time.monotonic() - started < 2

    asyncio.run(main())


def test_hung_scheduler_fails_within_the_timeout() -> None:
    with socket.socket() as silent:  # accepts TCP connections, never answers a byte
        silent.bind(("127.0.0.1", 0))
        silent.listen()

        async def main() -> None:
            async with AsyncClient(f"127.0.0.1:{silent.getsockname()[1]}", timeout=0.5) as client:
                started = time.monotonic()
                with pytest.raises(SchedulerUnavailable, match="is unavailable"):
                    await collect(client)
                assert time.monotonic() - started < 1.5

        asyncio.run(main())


def test_stats_and_load(scheduler: FakeSchedulerServer) -> None:
    async def main() -> tuple[pb.Stats, pb.Load, bool]:
        async with AsyncClient(scheduler.address) as client:
            return await client.get_stats(), await client.get_load(), await client.health()

    stats, load, healthy = asyncio.run(main())
    assert healthy and stats.max_model_len == 2048 and stats.block_size == 16
    assert load.kv_cache_usage == pytest.approx(0.25)


def test_unhealthy_scheduler_is_not_connected_to(scheduler: FakeSchedulerServer) -> None:
    scheduler.servicer.healthy = False

    async def main() -> None:
        async with AsyncClient(scheduler.address) as client:
            assert not await client.health()
            with pytest.raises(SchedulerUnavailable, match="not healthy"):
                await client.connect()

    asyncio.run(main())


def test_close_fails_pending_requests(scheduler: FakeSchedulerServer) -> None:
    scheduler.servicer.step_delay_s = 0.05

    async def main() -> None:
        client = AsyncClient(scheduler.address)
        task = asyncio.create_task(collect(client, sampling_params=SamplingParams(max_tokens=1000)))
        await asyncio.sleep(0.2)
        await client.close()
        with pytest.raises(SchedulerUnavailable, match="closed"):
            await task

    asyncio.run(main())
    wait_until(lambda: len(scheduler.servicer.aborted) == 1, what="stream close to abort the request")


def test_sync_client(scheduler: FakeSchedulerServer) -> None:
    with Client(scheduler.address) as client:
        assert client.health()
        assert client.get_stats().model == "fake-model"
        assert client.get_load().kv_cache_usage == pytest.approx(0.25)
        outputs = list(client.generate([1, 2], SamplingParams(max_tokens=3)))
        assert [t for o in outputs for t in o.new_token_ids] == [10, 11, 12]

        iterator = client.generate([1], SamplingParams(max_tokens=1000), request_id="sync-early")
        next(iterator)
        iterator.close()
        wait_until(lambda: scheduler.servicer.aborted == ["sync-early"], what="abort")

        scheduler.servicer.step_delay_s = 0.05
        iterator = client.generate([1], SamplingParams(max_tokens=1000), request_id="sync-abort")
        next(iterator)
        client.abort("sync-abort")
        assert list(iterator)[-1].finish_reason == "abort"


def test_sync_client_reports_unreachable_scheduler() -> None:
    with Client(dead_address()) as client:
        assert not client.health()
        with pytest.raises(SchedulerUnavailable):
            list(client.generate([1], SamplingParams(max_tokens=3)))


def test_closing_a_stream_whose_reader_never_ran_still_ends_its_requests() -> None:
    """A client dropped (e.g. by the gateway's router) right after its stream opened: the reader
    task is cancelled before it ever ran, so its `finally` never runs; close() itself must still
    end every request waiting on the stream, or they would wait forever."""
    from services.client.grpc_client import _GenerateStream, _StreamBroken

    class Call:
        def cancel(self) -> None:
            pass

        def __aiter__(self):
            return self

        async def __anext__(self):
            await asyncio.sleep(3600)

    class Stub:
        def Generate(self, requests, **kwargs) -> Call:  # noqa: N802
            return Call()

    async def scenario() -> object:
        stream = _GenerateStream(Stub())
        queue: asyncio.Queue = asyncio.Queue()
        stream.waiting["r"] = queue
        await stream.close("dropped")  # no await before it: the reader task has not started
        return await asyncio.wait_for(queue.get(), 1)

    item = asyncio.run(scenario())
    assert isinstance(item, _StreamBroken) and item.reason == "dropped"


def test_a_large_abort_goes_in_messages_any_scheduler_reads() -> None:
    """A scheduler reads one request's worth of bytes per message: aborting thousands of requests
    with the longest legal ids at once goes in several messages, every id in order."""
    from services.common.message_limits import MAX_REQUEST_ID_CHARS, generate_request_bytes, receive_limit

    sent: list[pb.ClientMessage] = []

    class _Stream:
        waiting: dict = {}

        def send(self, message: pb.ClientMessage) -> None:
            sent.append(message)

    ids = [f"{i:05d}" + "\U0001f600" * (MAX_REQUEST_ID_CHARS - 5) for i in range(3000)]
    AsyncClient("127.0.0.1:1")._abort_now(_Stream(), ids)
    assert [i for m in sent for i in m.abort.request_ids] == ids
    assert max(m.ByteSize() for m in sent) <= receive_limit(generate_request_bytes(2))  # the smallest model's
