"""gRPC client SDK for the scheduler service.

`AsyncClient` multiplexes every request of one process over ONE long-lived
`Scheduler.Generate` bidi stream (the scheduler aborts all of a stream's requests when
the stream closes, so one stream per gateway is the unit of "this connection died").
A reader task dispatches each `RequestOutput` of a `StepOutputs` batch to the queue of
the request it belongs to; `generate()` drains that queue.

`Client` is a blocking wrapper for scripts: it runs an `AsyncClient` on an event loop
in a background thread.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Iterator
from typing import Any

import grpc

from services.common.auth import token_from_env, token_metadata
from services.common.grpc_utils import CHANNEL_OPTIONS, cancelled_from_outside
from services.common.proto import myvllm_pb2 as pb
from services.common.proto import myvllm_pb2_grpc as pb_grpc
from services.common.sampling_params import SamplingParams
from services.common.serve_connection import find_serve

__all__ = ["AsyncClient", "Client", "RequestRejected", "SchedulerUnavailable"]

DEFAULT_TIMEOUT_S = 2.0

# The services' options (keepalive, a reconnect backoff of at most a second), plus:
# - each channel its own subchannels. gRPC otherwise shares them process-wide, and a fresh
#   channel made after a failure (see _reset_channel) would inherit the old one's backoff;
# - no receive limit: how large one step's outputs can be (prompt logprobs of every token
#   the step computed) follows from the scheduler's configuration, which a client does not
#   know before it connects, and a client reads only from the scheduler it chose.
_CHANNEL_OPTIONS = CHANNEL_OPTIONS + [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", -1)]
# Ids per abort message: a scheduler reads one request's worth of bytes per message (at least
# ~1 MB, message_limits.generate_request_bytes); this many ids of the longest legal kind fit.
_ABORT_IDS_PER_MESSAGE = 512


class SchedulerUnavailable(ConnectionError):
    """The scheduler cannot be reached, or the Generate stream broke mid-request."""


class SchedulerAuthError(SchedulerUnavailable):
    """The scheduler refused this client's internal token (none, or not the mesh's)."""


def _resolve(address: str | None, token: str | None, http_port: int | None) -> tuple[str, str | None]:
    """The scheduler to talk to and the token to present: an explicit address (token: the given
    one, else $MYVLLM_INTERNAL_TOKEN), or the running `myvllm serve` on this machine
    (services/common/serve_connection.py), whose token it wrote for its user."""
    if address is not None:
        return address, token_from_env(token)
    serve = find_serve(http_port)
    return serve.schedulers[0], token or serve.token


class RequestRejected(RuntimeError):
    """The scheduler refused or failed a request (`RequestOutput.error` was set).

    `error_kind` says whose fault it was (`pb.ErrorKind`): INVALID_REQUEST is the client's;
    ENGINE_FAULT and UNAVAILABLE are the engine's (a gateway migrates such a request);
    RESOURCE_EXHAUSTED is backpressure (a full waiting queue: retry later, not elsewhere at once).
    """

    def __init__(self, request_id: str, message: str, error_kind: int = pb.ERROR_KIND_UNSPECIFIED) -> None:
        super().__init__(f"request {request_id} rejected by the scheduler: {message}")
        self.request_id = request_id
        self.message = message
        self.error_kind = error_kind

    @property
    def is_engine_failure(self) -> bool:
        """Not the client's mistake (an old peer that sets no kind counts as an engine fault)."""
        return self.error_kind not in (pb.INVALID_REQUEST, pb.RESOURCE_EXHAUSTED)


class _StreamBroken:
    """Queued to every waiting request when the stream dies; each waiter raises its own
    `SchedulerUnavailable` (sharing one exception object would tangle tracebacks)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


_QueueItem = pb.RequestOutput | _StreamBroken


class _GenerateStream:
    """One open `Scheduler.Generate` call and the requests waiting on it."""

    def __init__(self, stub: pb_grpc.SchedulerStub, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        # None ends the request iterator, i.e. half-closes the stream.
        self._outgoing: asyncio.Queue[pb.ClientMessage | None] = asyncio.Queue()
        self.waiting: dict[str, asyncio.Queue[_QueueItem]] = {}
        self.closed = False
        self._close_reason = "the scheduler closed the Generate stream"
        self._call = stub.Generate(self._outgoing_messages(), wait_for_ready=False, metadata=metadata)
        self._reader = asyncio.create_task(self._dispatch_outputs(), name="myvllm-generate-reader")

    async def _outgoing_messages(self) -> AsyncIterator[pb.ClientMessage]:
        while (message := await self._outgoing.get()) is not None:
            yield message

    def send(self, message: pb.ClientMessage) -> None:
        """Queue a message for the stream; never blocks, so it is safe in `finally`."""
        if not self.closed:
            self._outgoing.put_nowait(message)

    async def _dispatch_outputs(self) -> None:
        reason = None
        try:
            async for step in self._call:
                for output in step.outputs:
                    queue = self.waiting.get(output.request_id)
                    if queue is None:
                        continue  # an output that crossed our abort on the wire
                    if output.finish_reason or output.error:
                        del self.waiting[output.request_id]
                    queue.put_nowait(output)
        except grpc.aio.AioRpcError as e:
            reason = f"scheduler stream failed ({e.code().name}: {e.details()})"
        except asyncio.CancelledError:
            pass  # close() cancelled us; its reason is already set
        finally:
            self._fail_waiting(reason or self._close_reason)

    def _fail_waiting(self, reason: str) -> None:
        """Mark the stream closed and end every request still waiting on it (idempotent)."""
        self.closed = True
        broken = _StreamBroken(reason)
        for queue in self.waiting.values():
            queue.put_nowait(broken)
        self.waiting.clear()
        self._outgoing.put_nowait(None)

    async def close(self, reason: str) -> None:
        self._close_reason = reason
        self._outgoing.put_nowait(None)
        self._call.cancel()
        self._reader.cancel()
        try:
            await self._reader
        except asyncio.CancelledError:
            pass
        # A reader cancelled before it ever ran never reached its `finally`: its waiters would wait forever.
        self._fail_waiting(reason)


def _ids_list(request_ids: str | Iterable[str]) -> list[str]:
    return [request_ids] if isinstance(request_ids, str) else list(request_ids)


class AsyncClient:
    """Asyncio client of one scheduler (`host:port`).

    All `generate()` calls share one bidi stream, opened lazily. If it breaks, every
    in-flight `generate()` raises `SchedulerUnavailable` and the next call reconnects.
    Must be used from a single event loop.
    """

    def __init__(self, address: str | None = None, timeout: float = DEFAULT_TIMEOUT_S, token: str | None = None,
                 http_port: int | None = None) -> None:
        """`address`: the scheduler's host:port (None: the `myvllm serve` running on this machine,
        the one on `http_port` if several). `timeout` bounds connecting and each unary RPC, so a
        dead scheduler is reported within that many seconds instead of hanging. `token` is the
        mesh's internal token (default: $MYVLLM_INTERNAL_TOKEN, or the found serve's), sent with
        every call. FileNotFoundError: no address and no serve found."""
        self.address, token = _resolve(address, token, http_port)
        self.timeout = timeout
        self.metadata = token_metadata(token)
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.SchedulerStub | None = None
        self._stream: _GenerateStream | None = None
        self._connect_lock = asyncio.Lock()
        self._retiring_channels: dict[grpc.aio.Channel, asyncio.Task[None]] = {}
        self._closed = False

    # ------------------------------------------------------------------ connection

    def _get_stub(self) -> pb_grpc.SchedulerStub:
        if self._closed:
            raise SchedulerUnavailable("client is closed")
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=_CHANNEL_OPTIONS)
            self._stub = pb_grpc.SchedulerStub(self._channel)
        return self._stub

    def _reset_channel(self) -> None:
        # A fresh channel skips whatever reconnect backoff the old one was sitting in.
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            # Other calls may still be in flight on it: let them end by their own
            # deadlines (closing now would cancel them) before it goes.
            closing = asyncio.create_task(channel.close(grace=self.timeout))
            self._retiring_channels[channel] = closing
            closing.add_done_callback(lambda _: self._retiring_channels.pop(channel, None))

    async def _unary(self, method_name: str) -> Any:
        method = getattr(self._get_stub(), method_name)
        try:
            return await method(pb.Empty(), timeout=self.timeout, wait_for_ready=False, metadata=self.metadata)
        except asyncio.CancelledError:
            if cancelled_from_outside():
                raise
            # The channel was closed under the call (a concurrent call replaced it, see
            # _reset_channel): the scheduler did not answer, which callers already handle.
            raise SchedulerUnavailable(f"scheduler at {self.address} is unavailable (its call was cancelled "
                                       "when the channel was replaced)") from None
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                raise SchedulerAuthError(
                    f"scheduler at {self.address} refused this client's internal token ({e.details()}): pass "
                    "token=..., or set MYVLLM_INTERNAL_TOKEN; for `myvllm serve` on this machine leave the "
                    "address out and the client reads its token") from None
            if e.code() == grpc.StatusCode.UNAVAILABLE and (self._stream is None or self._stream.closed):
                # Without this the next call would fail instantly while the channel
                # sits in reconnect backoff, even if the scheduler is back by then.
                self._reset_channel()
            raise SchedulerUnavailable(
                f"scheduler at {self.address} is unavailable ({e.code().name}: {e.details()})"
            ) from None

    async def connect(self) -> None:
        """Open the shared Generate stream now (it opens lazily otherwise).

        Raises `SchedulerUnavailable` within `timeout` seconds if the scheduler is down.
        """
        await self._open_stream()

    async def _open_stream(self) -> _GenerateStream:
        stream = self._stream
        if stream is not None and not stream.closed:
            return stream
        async with self._connect_lock:
            stream = self._stream
            if stream is not None and not stream.closed:
                return stream
            if stream is not None:
                self._reset_channel()
                self._stream = None
            # A bidi stream only fails once a message moves; a Health call with a
            # deadline turns "nobody is listening" into a prompt, clear error.
            response = await self._unary("Health")
            if not response.ok:
                raise SchedulerUnavailable(f"scheduler at {self.address} is not healthy: {response.detail}")
            self._stream = _GenerateStream(self._get_stub(), self.metadata)
            return self._stream

    # ------------------------------------------------------------------ requests

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | pb.SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str = "",
        resumed_output_token_ids: list[int] | None = None,
        dp_wave: int = 0,
        pooling: pb.PoolingParams | None = None,
        kv_transfer_params: pb.KVTransferParams | None = None,
        lora_request: pb.LoRARequest | None = None,
    ) -> AsyncGenerator[pb.RequestOutput, None]:
        """Submit one request and yield its `RequestOutput`s as engine steps produce them.

        The iteration ends after the output whose `finish_reason` is set. Leaving the
        loop early (break, cancellation, `aclose()`) aborts the request in the scheduler.
        Raises `SchedulerUnavailable` if the stream breaks and `RequestRejected` if the
        scheduler refuses the request. `resumed_output_token_ids` (request migration): the
        tokens this request already generated elsewhere; only tokens after them come back.
        `dp_wave`: the expert-parallel group's wave the sender last saw (services/common/dp_wave.py).
        `pooling`: an embedding request (a pooling engine; `sampling_params` is ignored): one output,
        its `pooled_output` the embedding. `kv_transfer_params` (P/D disaggregation, an engine with
        --kv-transfer-config): do_remote_decode, whose final output carries the params for the
        consumer; or do_remote_prefill with those params. `lora_request`: run with that LoRA adapter
        (an engine with --enable-lora).
        """
        if isinstance(sampling_params, SamplingParams):
            sampling_params = sampling_params.to_proto()
        request_id = request_id or uuid.uuid4().hex
        stream = await self._open_stream()
        if request_id in stream.waiting:
            raise ValueError(f"request id {request_id!r} is already in flight")
        queue: asyncio.Queue[_QueueItem] = asyncio.Queue()
        stream.waiting[request_id] = queue
        stream.send(pb.ClientMessage(generate=pb.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling_params,
            priority=priority,
            cache_salt=cache_salt,
            resumed_output_token_ids=resumed_output_token_ids or [],
            dp_wave=dp_wave,
            pooling=pooling,
            kv_transfer_params=kv_transfer_params,
            lora_request=lora_request,
        )))
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, _StreamBroken):
                    finished = True  # the scheduler already dropped it with the stream
                    raise SchedulerUnavailable(f"request {request_id} lost: {item.reason}")
                if item.error:
                    finished = True
                    raise RequestRejected(request_id, item.error, item.error_kind)
                finished = bool(item.finish_reason)
                yield item
        finally:
            if not finished:
                # The consumer walked away: free the request's KV blocks in the scheduler.
                self._abort_now(stream, [request_id])

    def _abort_now(self, stream: _GenerateStream, request_ids: list[str]) -> None:
        for request_id in request_ids:
            queue = stream.waiting.pop(request_id, None)
            if queue is not None:
                # The scheduler need not echo aborts; end the local iteration ourselves.
                queue.put_nowait(pb.RequestOutput(request_id=request_id, finish_reason="abort", stop_token_id=-1))
        for start in range(0, len(request_ids), _ABORT_IDS_PER_MESSAGE):
            chunk = request_ids[start:start + _ABORT_IDS_PER_MESSAGE]
            stream.send(pb.ClientMessage(abort=pb.AbortRequest(request_ids=chunk)))

    async def abort(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests; their `generate()` iterations end with finish_reason "abort"."""
        stream = self._stream
        if stream is not None and not stream.closed:
            self._abort_now(stream, _ids_list(request_ids))

    # ------------------------------------------------------------------ unary calls

    async def health(self) -> bool:
        """True if the scheduler answers Health with ok within `timeout`."""
        try:
            return bool((await self._unary("Health")).ok)
        except SchedulerUnavailable:
            return False

    async def get_stats(self) -> pb.Stats:
        """The scheduler's counters and configuration (max_model_len, block_size, ...)."""
        return await self._unary("GetStats")

    async def get_load(self) -> pb.Load:
        """Queue lengths and KV usage, as used for data-parallel routing."""
        return await self._unary("GetLoad")

    async def kv_events(self) -> AsyncGenerator[pb.KvEventBatch, None]:
        """The scheduler's prefix-cache events (SubscribeKvEvents): a snapshot, then one batch
        per engine step, until the caller stops or the stream breaks (`SchedulerUnavailable`;
        subscribe again for a fresh snapshot)."""
        await self._unary("Health")  # a down scheduler fails within `timeout`, not never
        call = self._get_stub().SubscribeKvEvents(pb.Empty(), wait_for_ready=False, metadata=self.metadata)
        try:
            async for batch in call:
                yield batch
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE and (self._stream is None or self._stream.closed):
                self._reset_channel()
            raise SchedulerUnavailable(
                f"KV events of scheduler at {self.address} broke ({e.code().name}: {e.details()})") from None
        finally:
            call.cancel()
        raise SchedulerUnavailable(f"scheduler at {self.address} ended its KV event stream")

    async def close(self) -> None:
        """Close the stream (in-flight requests raise `SchedulerUnavailable`) and channel."""
        self._closed = True
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.close("the client was closed")
        channels = [*self._retiring_channels, *([self._channel] if self._channel else [])]
        self._channel = self._stub = None
        for channel in channels:
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def _finish_tasks() -> None:
    """Let the loop's other tasks (gRPC's call bookkeeping) run to their end, as asyncio.run does
    before it closes a loop."""
    await asyncio.sleep(0)
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class Client:
    """Blocking client for scripts: an `AsyncClient` on a private event-loop thread.

    Usable as a context manager; `generate()` returns a plain iterator.
    """

    def __init__(self, address: str | None = None, timeout: float = DEFAULT_TIMEOUT_S, token: str | None = None,
                 http_port: int | None = None) -> None:
        """As `AsyncClient`: no address = the `myvllm serve` running on this machine."""
        address, token = _resolve(address, token, http_port)
        self.address = address
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="myvllm-sdk-client", daemon=True)
        self._thread.start()
        self._closed = False

        async def make_client() -> AsyncClient:
            return AsyncClient(address, timeout, token)  # built on the loop that will use it

        self._async_client = self._run(make_client())

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | pb.SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str = "",
        resumed_output_token_ids: list[int] | None = None,
    ) -> Iterator[pb.RequestOutput]:
        """Like `AsyncClient.generate`; closing the iterator early aborts the request."""
        outputs = self._async_client.generate(prompt_token_ids, sampling_params, request_id, priority, cache_salt,
                                              resumed_output_token_ids)
        try:
            while True:
                try:
                    yield self._run(outputs.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if not self._closed:
                self._run(outputs.aclose())

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests by id."""
        self._run(self._async_client.abort(request_ids))

    def health(self) -> bool:
        """True if the scheduler is reachable and healthy."""
        return self._run(self._async_client.health())

    def get_stats(self) -> pb.Stats:
        """The scheduler's `Stats`."""
        return self._run(self._async_client.get_stats())

    def get_load(self) -> pb.Load:
        """The scheduler's `Load`."""
        return self._run(self._async_client.get_load())

    def close(self) -> None:
        """Close the connection and stop the background loop thread."""
        if self._closed:
            return
        self._run(self._async_client.close())
        self._run(_finish_tasks())  # (gRPC's own tasks end here, not destroyed pending with the loop)
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
