"""A fake `Scheduler` gRPC service for gateway and SDK tests.

It speaks the real proto but runs no model: each step it emits one token per active
request from a script (by default a fixed token sequence, repeated), honouring
max_tokens, EOS / stop_token_ids, aborts, stream close and resumed (migrated) requests,
and it records what it was sent so tests can assert, e.g., that a client disconnect
reached the scheduler as an abort. `FakeSchedulerServer` runs it on a free loopback port in a background thread so
synchronous tests (and a uvicorn gateway in another thread) can talk to it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from services.common.proto import myvllm_pb2 as pb
from services.common.proto import myvllm_pb2_grpc as pb_grpc

# (request) -> the tokens it should produce, repeated cyclically until a stop.
TokenScript = Callable[[pb.GenerateRequest], list[int]]
# (request) -> an error message to reject it with, or None to accept it.
RejectRule = Callable[[pb.GenerateRequest], str | None]


@dataclass
class _Running:
    request: pb.GenerateRequest
    script: list[int]
    num_generated: int = 0


FAKE_TIMINGS = pb.RequestTimings(queued_s=0.25, prefill_s=0.5, decode_s=1.5, inference_s=2.0)


@dataclass
class FakeScheduler(pb_grpc.SchedulerServicer):
    """Scripted scheduler. Public attributes are safe to read from other threads."""

    script: TokenScript | list[int] = field(default_factory=lambda: [100, 101, 102])
    eos_token_id: int = 2
    max_model_len: int = 2048
    step_delay_s: float = 0.001
    model: str = "fake-model"
    reject: RejectRule | None = None
    reject_kind: int = pb.INVALID_REQUEST  # the ErrorKind rejections carry
    # > 0: a request (not a resumed one) fails with ENGINE_FAULT after this many tokens.
    fail_after_tokens: int = 0
    healthy: bool = True
    # LoRA as the engine reports it (0: --enable-lora off) and the rank it takes.
    max_lora: int = 0
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.aborted: list[str] = []  # explicit aborts and those caused by stream close
        self.num_streams_opened = 0
        self.num_streams_closed = 0
        # While cleared, no step runs: requests sit "waiting", as in a full engine.
        self.running = threading.Event()
        self.running.set()

    def tokens_for(self, request: pb.GenerateRequest) -> list[int]:
        return list(self.script(request)) if callable(self.script) else list(self.script)

    # -------------------------------------------------------------- the service

    async def Generate(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        self.num_streams_opened += 1
        active: dict[str, _Running] = {}
        rejected: list[pb.RequestOutput] = []
        wake = asyncio.Event()
        client_done = False

        async def read_client() -> None:
            nonlocal client_done
            try:
                async for message in request_iterator:
                    if message.HasField("generate"):
                        request = message.generate
                        self.requests.append(request)
                        error = self.reject(request) if self.reject else None
                        if error:
                            rejected.append(pb.RequestOutput(
                                request_id=request.request_id, finish_reason="abort", error=error,
                                stop_token_id=-1, num_prompt_tokens=len(request.prompt_token_ids),
                                error_kind=self.reject_kind))
                        else:
                            # A migrated request continues its script where it left off.
                            active[request.request_id] = _Running(request, self.tokens_for(request),
                                                                  len(request.resumed_output_token_ids))
                    else:
                        for request_id in message.abort.request_ids:
                            if active.pop(request_id, None) is not None:
                                self.aborted.append(request_id)
                    wake.set()
            finally:
                client_done = True
                wake.set()

        reader = asyncio.create_task(read_client())
        try:
            while not client_done:
                if not (active or rejected):
                    wake.clear()
                    await wake.wait()
                    continue
                while not self.running.is_set():
                    await asyncio.sleep(0.005)
                await asyncio.sleep(self.step_delay_s)
                outputs, rejected[:] = list(rejected), []
                for request_id, running in list(active.items()):
                    output = self._step(running)
                    outputs.append(output)
                    if output.finish_reason:
                        del active[request_id]
                if outputs:
                    yield pb.StepOutputs(outputs=outputs)
        finally:
            # Stream closed (or the server stopped): like the real scheduler, abort the rest.
            self.aborted.extend(active)
            self.num_streams_closed += 1
            reader.cancel()

    def _step(self, running: _Running) -> pb.RequestOutput:
        request, sampling = running.request, running.request.sampling
        if self.fail_after_tokens and not request.resumed_output_token_ids and \
                running.num_generated == self.fail_after_tokens:
            return pb.RequestOutput(request_id=request.request_id, finish_reason="abort", stop_token_id=-1,
                                    error="engine step failed: injected fault", error_kind=pb.ENGINE_FAULT)
        token = running.script[running.num_generated % len(running.script)]
        running.num_generated += 1
        output = pb.RequestOutput(
            request_id=request.request_id, new_token_ids=[token], stop_token_id=-1,
            num_prompt_tokens=len(request.prompt_token_ids))
        if sampling.logprobs >= 0:
            k = sampling.logprobs
            output.logprobs.append(pb.TokenLogprobs(
                logprob=-0.25, rank=1, top_ids=[token + i for i in range(k)],
                top_logprobs=[-0.25 - i for i in range(k)]))
        is_eos = token == self.eos_token_id and not sampling.ignore_eos
        if (is_eos or token in sampling.stop_token_ids) and running.num_generated > sampling.min_tokens:
            output.finish_reason, output.stop_token_id = "stop", token
        elif sampling.max_tokens and running.num_generated >= sampling.max_tokens:
            output.finish_reason = "length"
        elif len(request.prompt_token_ids) + running.num_generated >= self.max_model_len:
            output.finish_reason = "length"
        if output.finish_reason:  # (the engine's account of the request's time, as a real one sends)
            output.timings.CopyFrom(FAKE_TIMINGS)
        return output

    async def Health(self, request, context):  # noqa: N802
        return pb.HealthResponse(ok=self.healthy, detail="" if self.healthy else "fake is unhealthy")

    async def GetLoad(self, request, context):  # noqa: N802
        return pb.Load(num_waiting=0, num_running=0, kv_cache_usage=0.25)

    async def GetStats(self, request, context):  # noqa: N802
        return pb.Stats(
            num_free_blocks=75, num_total_blocks=100, prefix_cache_queries=40, prefix_cache_hits=10,
            num_preemptions=3, num_waiting=1, num_running=2, kv_cache_usage=0.25,
            max_model_len=self.max_model_len, model=self.model, block_size=16, num_steps=7,
            iteration_tokens_counts=[0, 2, 1] + [0] * 11, iteration_tokens_sum=30, spec_decode_enabled=True,
            enable_prefix_caching=True, dtype="float32", attention_backend="torch", max_lora=self.max_lora,
            max_lora_rank=self.max_lora_rank,
            running_lora_adapters=sorted({r.lora_request.lora_name for r in self.requests
                                          if r.HasField("lora_request")}) if self.max_lora else [])


async def start_fake_scheduler(servicer: FakeScheduler, port: int = 0) -> tuple[grpc.aio.Server, str]:
    """Serve `servicer` on the current loop; returns the server and its `host:port`."""
    server = grpc.aio.server()
    pb_grpc.add_SchedulerServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{bound}"


class FakeSchedulerServer:
    """Runs a `FakeScheduler` on a free loopback port in a background thread.

    `stop()` kills it abruptly (open streams break, like a crashed scheduler);
    `start()` again reuses the same port, so tests can check reconnects.
    """

    def __init__(self, servicer: FakeScheduler | None = None, port: int = 0) -> None:
        self.servicer = servicer or FakeScheduler()
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> FakeSchedulerServer:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-scheduler", daemon=True)
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(start_fake_scheduler(self.servicer, self.port), self._loop)
        self._server, address = future.result(timeout=10)
        self.port = int(address.rsplit(":", 1)[1])
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._server.stop(grace=None), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
        self._loop = self._thread = self._server = None

    def __enter__(self) -> FakeSchedulerServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> None:
    """Poll `condition` until it holds; fail the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)
