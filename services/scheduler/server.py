"""The scheduler service: proto `Scheduler` over grpc.aio, driving its workers' Execute stream.

One asyncio task runs the engine loop (schedule → send the batch to the worker → read the
sampled ids → fold them in → route outputs). Gateway streams only put requests in and take
outputs from unbounded per-stream queues, so a slow gateway never stalls the loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import deque

import grpc

from services.common.config import EngineConfig
from services.common.grpc_utils import GRPC_OPTIONS, StartupError, bind_or_fail, channel
from services.common.proto import myvllm_pb2 as pb
from services.common.proto import myvllm_pb2_grpc as pb_grpc
from services.scheduler.engine_core import EngineCore, choose_num_blocks, kv_capacity_request, load_model_request
from services.scheduler.load_reporter import LoadReporter

logger = logging.getLogger("myvllm.scheduler")


class WorkerLink:
    """The scheduler's connection to one worker: set-up calls and the Execute stream."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = channel(address)
        self.stub = pb_grpc.WorkerStub(self.channel)
        self.stream = None

    async def connect(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise StartupError(f"scheduler: worker at {self.address} is unreachable") from None

    async def send(self, so: pb.SchedulerOutput) -> None:
        if self.stream is None:
            self.stream = self.stub.Execute()
        await self.stream.write(so)

    async def receive(self) -> pb.ModelRunnerOutput:
        out = await self.stream.read()
        if out is grpc.aio.EOF:
            raise RuntimeError(f"worker at {self.address} closed its Execute stream")
        return out

    def reset(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
        self.stream = None


class _ClientStream:
    """One gateway connection: where its requests' outputs go."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[pb.StepOutputs] = asyncio.Queue()
        self.request_ids: set[str] = set()


LOAD_HEARTBEAT_S = 1.0


class SchedulerServicer(pb_grpc.SchedulerServicer):
    def __init__(self, config: EngineConfig, worker: WorkerLink, load_reporter: LoadReporter | None = None) -> None:
        self.config = config
        self.worker = worker
        self.core: EngineCore | None = None
        self.owners: dict[str, _ClientStream] = {}
        self.work_available = asyncio.Event()
        self.load_reporter = load_reporter
        self.loop_task: asyncio.Task | None = None
        self.heartbeat_task: asyncio.Task | None = None
        self.fatal_error: str | None = None

    async def start(self) -> None:
        """Load the model on the worker, size the KV cache, start the engine loop."""
        try:
            info = await self.worker.stub.LoadModel(load_model_request(self.config))
            capacity = await self.worker.stub.GetKVCapacity(kv_capacity_request(self.config))
            num_blocks = choose_num_blocks(self.config, capacity, info.max_model_len)
            await self.worker.stub.InitKVCache(pb.InitKVCacheRequest(num_blocks=num_blocks,
                                                                     block_size=self.config.block_size))
        except grpc.aio.AioRpcError as e:
            raise StartupError(f"scheduler: worker at {self.worker.address} refused: {e.details()}") from None
        except ValueError as e:
            raise StartupError(f"scheduler: {e}") from None
        self.config.model = info.model
        self.core = EngineCore(self.config, info, num_blocks)
        self.loop_task = asyncio.create_task(self._engine_loop())
        if self.load_reporter is not None:
            self.heartbeat_task = asyncio.create_task(self._heartbeat())

    async def _heartbeat(self) -> None:
        """An idle engine takes no steps, so nothing else would refresh its Redis entry;
        gateways drop replicas whose entry goes stale."""
        while True:
            await asyncio.sleep(LOAD_HEARTBEAT_S)
            self._report_load()

    # ------------------------------------------------------------------ engine loop

    async def _engine_loop(self) -> None:
        """Schedule, send, receive, fold in. With async scheduling two steps are in flight:
        step N+1 is scheduled and on the wire while the worker still computes step N."""
        core = self.core
        depth = 2 if self.config.async_scheduling else 1
        in_flight: deque[pb.SchedulerOutput] = deque()
        while True:
            while len(in_flight) < depth and core.has_unfinished_requests():
                so = core.schedule()
                if not so.num_scheduled_tokens:
                    break  # nothing fits right now (e.g. blocks an abort will free)
                try:
                    await self.worker.send(so)
                except Exception as e:
                    self._fail_all(in_flight, e)
                    break
                in_flight.append(so)
            if not in_flight:
                self._report_load()
                self.work_available.clear()
                await self.work_available.wait()
                continue
            so = in_flight.popleft()
            try:
                outputs = core.process(so, await self.worker.receive())
            except Exception as e:  # the worker failed: fail every live request, keep serving
                self._fail_all(in_flight, e)
                continue
            self._route(outputs)
            self._report_load()
            await asyncio.sleep(0)  # let gateway streams run between steps

    def _fail_all(self, in_flight: deque, error: Exception) -> None:
        logger.error("engine step failed: %s", error)
        in_flight.clear()
        self.worker.reset()
        outputs = self.core.abort(list(self.core.scheduler.requests))
        for out in outputs:
            out.error = f"engine step failed: {error}"
        self._route(outputs)

    def _route(self, outputs: list[pb.RequestOutput]) -> None:
        per_stream: dict[int, tuple[_ClientStream, pb.StepOutputs]] = {}
        for out in outputs:
            stream = self.owners.get(out.request_id)
            if stream is None:
                continue
            entry = per_stream.get(id(stream))
            if entry is None:
                entry = per_stream[id(stream)] = (stream, pb.StepOutputs())
            entry[1].outputs.append(out)
            if out.finish_reason:
                del self.owners[out.request_id]
                stream.request_ids.discard(out.request_id)
        for stream, step in per_stream.values():
            stream.queue.put_nowait(step)

    def _report_load(self) -> None:
        if self.load_reporter is not None:
            self.load_reporter.report(self.core.load())

    # ------------------------------------------------------------------ RPCs

    def _add(self, stream: _ClientStream, req: pb.GenerateRequest) -> None:
        error = None
        if req.request_id in self.owners or not req.request_id:
            error = f"request id {req.request_id!r} is empty or already in use"
        else:
            try:
                self.core.add_request(req)
            except ValueError as e:
                error = str(e)
        if error is not None:
            stream.queue.put_nowait(pb.StepOutputs(outputs=[pb.RequestOutput(
                request_id=req.request_id, finish_reason="abort", error=error, stop_token_id=-1,
                error_kind=pb.INVALID_REQUEST)]))
            return
        self.owners[req.request_id] = stream
        stream.request_ids.add(req.request_id)
        self.work_available.set()

    def _abort(self, request_ids: list[str]) -> None:
        outputs = self.core.abort(request_ids)
        self._route(outputs)
        self.work_available.set()  # freed blocks may let waiting requests in

    async def _read_client(self, request_iterator, stream: _ClientStream) -> None:
        async for msg in request_iterator:
            kind = msg.WhichOneof("kind")
            if kind == "generate":
                self._add(stream, msg.generate)
            elif kind == "abort":
                self._abort([r for r in msg.abort.request_ids if self.owners.get(r) is stream])

    async def Generate(self, request_iterator, context: grpc.aio.ServicerContext):
        if self.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler is still starting")
        stream = _ClientStream()
        reader = asyncio.create_task(self._read_client(request_iterator, stream))
        getter: asyncio.Task | None = None
        try:
            while True:
                getter = asyncio.ensure_future(stream.queue.get())
                done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield getter.result()
                    continue
                getter.cancel()
                if reader.exception() is not None and not isinstance(reader.exception(), asyncio.CancelledError):
                    logger.warning("gateway stream failed: %s", reader.exception())
                # The client closed its side: flush what is queued for it, then end.
                while not stream.queue.empty() and stream.request_ids:
                    yield stream.queue.get_nowait()
                break
        finally:
            if getter is not None:
                getter.cancel()
            reader.cancel()
            # A gateway that went away cannot receive its outputs: free their blocks.
            if stream.request_ids:
                ids = list(stream.request_ids)
                for rid in ids:
                    self.owners.pop(rid, None)
                self.core.abort(ids)
                self.work_available.set()

    async def Health(self, request: pb.Empty, context) -> pb.HealthResponse:
        if self.core is None:
            return pb.HealthResponse(ok=False, detail="starting")
        if self.loop_task is not None and self.loop_task.done():
            return pb.HealthResponse(ok=False, detail=f"engine loop stopped: {self.loop_task.exception()}")
        return pb.HealthResponse(ok=True, detail="ready")

    async def GetLoad(self, request: pb.Empty, context) -> pb.Load:
        if self.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler is still starting")
        return self.core.load()

    async def GetStats(self, request: pb.Empty, context) -> pb.Stats:
        if self.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler is still starting")
        return self.core.stats()


def advertised_address(host: str, port: int) -> str:
    """The address gateways should dial: the bind host, unless that is a wildcard (then this
    machine's hostname)."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    return f"{host}:{port}"


async def serve_scheduler(host: str, port: int, config: EngineConfig, worker_addresses: list[str],
                          redis_url: str | None = None, engine_id: str | None = None,
                          connect_timeout: float = 120.0, advertise_address: str | None = None) -> None:
    if len(worker_addresses) != 1:
        raise StartupError("scheduler: exactly one worker is supported (tensor parallelism is not implemented)")
    worker = WorkerLink(worker_addresses[0])
    await worker.connect(connect_timeout)
    address = advertise_address or advertised_address(host, port)
    reporter = LoadReporter(redis_url, engine_id or address, address) if redis_url else None
    servicer = SchedulerServicer(config, worker, reporter)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    pb_grpc.add_SchedulerServicer_to_server(servicer, server)
    bind_or_fail(server, host, port, "scheduler")
    started = time.monotonic()
    await servicer.start()
    await server.start()
    logger.warning("scheduler serving on %s:%d (ready in %.1fs)", host, port, time.monotonic() - started)
    await server.wait_for_termination()
