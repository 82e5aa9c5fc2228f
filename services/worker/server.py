"""The worker service: proto `Worker` over grpc.aio, around the same `Worker` the offline LLM uses.

Model execution runs on one dedicated thread, so the event loop keeps answering Health
and reading the next batch off the stream while a step computes.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common.grpc_utils import GRPC_OPTIONS, bind_or_fail
from services.common.proto import myvllm_pb2 as pb
from services.common.proto import myvllm_pb2_grpc as pb_grpc
from services.worker.worker import Worker

logger = logging.getLogger("myvllm.worker")


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, default_load: pb.LoadModelRequest, device: str | None = None) -> None:
        self.default_load = default_load
        self.worker = Worker(device)
        self.compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-compute")
        self.loaded: pb.LoadModelRequest | None = None
        self.info: pb.ModelInfo | None = None

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.compute, fn, *args)

    async def LoadModel(self, request: pb.LoadModelRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        merged = pb.LoadModelRequest()
        merged.CopyFrom(self.default_load)
        # Fields the scheduler sets override the worker's own command-line defaults.
        for field, value in request.ListFields():
            setattr(merged, field.name, value)
        if self.loaded is not None and self.loaded == merged:
            return self.info  # a reconnecting scheduler: keep the loaded weights
        try:
            self.info = await self._run(self.worker.load_model, merged)
        except (FileNotFoundError, ValueError, NotImplementedError, KeyError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot load model: {e}")
        self.loaded = merged
        return self.info

    async def GetKVCapacity(self, request: pb.KVCapacityRequest, context) -> pb.KVCapacity:
        if self.worker.runner is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "LoadModel must be called first")
        return await self._run(self.worker.get_kv_capacity, request)

    async def InitKVCache(self, request: pb.InitKVCacheRequest, context) -> pb.Empty:
        if self.worker.runner is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "LoadModel must be called first")
        if request.num_blocks < 2 or request.block_size < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "need num_blocks >= 2 and block_size >= 1")
        return await self._run(self.worker.init_kv_cache, request)

    async def Execute(self, request_iterator, context):
        if self.worker.runner is None or self.worker.runner.input_batch is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "LoadModel and InitKVCache must come first")
        # A new scheduler stream starts from an empty batch.
        self.worker.runner.reset_batch()
        async for so in request_iterator:
            try:
                yield await self._run(self.worker.execute, so)
            except Exception as e:  # report, keep serving: the scheduler aborts the affected requests
                logger.error("step %d failed: %s", so.step_id, traceback.format_exc())
                self.worker.runner.reset_batch()
                yield pb.ModelRunnerOutput(step_id=so.step_id, error=f"{type(e).__name__}: {e}")

    async def Health(self, request: pb.Empty, context) -> pb.HealthResponse:
        loaded = self.worker.runner is not None
        return pb.HealthResponse(ok=True, detail="model loaded" if loaded else "no model loaded")


async def serve_worker(host: str, port: int, default_load: pb.LoadModelRequest, device: str | None = None,
                       preload: bool = True) -> None:
    servicer = WorkerServicer(default_load, device)
    if preload:
        # Load at start-up so `--model` errors surface here, before any scheduler connects.
        servicer.info = await servicer._run(servicer.worker.load_model, default_load)
        servicer.loaded = default_load
    server = grpc.aio.server(options=GRPC_OPTIONS)
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    bind_or_fail(server, host, port, "worker")
    await server.start()
    logger.warning("worker serving on %s:%d", host, port)
    await server.wait_for_termination()
