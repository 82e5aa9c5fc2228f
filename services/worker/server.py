"""The worker service: proto `Worker` over grpc.aio, around the same `Worker` the offline LLM uses.

Model execution runs on one dedicated thread, so the event loop keeps answering Health
and reading the next batch off the stream while a step computes. Everything that touches
the model runner's state goes through that thread, in order.

The worker loads its own model (`--model`, `--dtype`, ...) once at start; a scheduler's
LoadModel only sizes the batch (`max_num_seqs`) unless it names other weights, which must
be the worker's own model or lie under `--allowed-model-root`. InitKVCache refuses sizes
beyond what the device can hold.
"""

from __future__ import annotations

import asyncio
import logging
import os
import traceback
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common import grpc_utils
from services.common.auth import server_interceptors
from services.common.config import SHARED_PARTS, VllmConfig, config_mismatch_message, config_mismatches
from services.common.message_limits import MAX_ERROR_CHARS, WORKER_RECEIVE_BYTES
from services.common.proto import myvllm_pb2 as pb
from services.common.proto import myvllm_pb2_grpc as pb_grpc
from services.worker.kv_connector import serve_segment
from services.worker.model_runner import MemoryBudgetError
from services.worker.step_validation import InvalidStep
from services.worker.worker import Worker

logger = logging.getLogger("myvllm.worker")


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def _is_under(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([path, root]) == root


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, own: pb.LoadModelRequest, device: str | None = None,
                 allowed_model_root: str | None = None, token: str | None = None) -> None:
        self.own = own  # this worker's configuration, from its flags
        self.allowed_model_root = allowed_model_root
        self.worker = Worker(device, token)
        self.compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-compute")

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.compute, fn, *args)

    def _model_allowed(self, model: str) -> bool:
        if model == self.own.config.model_config.model:
            return True
        return self.allowed_model_root is not None and _is_under(model, self.allowed_model_root)

    async def preload(self) -> None:
        """Load the worker's own model at start-up, so `--model` errors surface before any
        scheduler connects (and the scheduler's LoadModel then finds it loaded)."""
        await self._run(self.worker.load_model, self.own)

    def _merged(self, request: pb.LoadModelRequest) -> pb.LoadModelRequest:
        """The LoadModel to run: the sender's configuration with this worker's model part where
        the sender leaves it out (a scheduler does). Raises _Refused."""
        own = self.own.config
        merged = pb.LoadModelRequest()
        merged.CopyFrom(request)
        config = merged.config
        if not config.HasField("model_config"):
            config.model_config.CopyFrom(own.model_config)
        elif os.path.realpath(config.model_config.model) == os.path.realpath(own.model_config.model):
            config.model_config.model = own.model_config.model  # the same directory spelt another way: no reload
        if not self._model_allowed(config.model_config.model):
            root = f" or a directory under {self.allowed_model_root}" if self.allowed_model_root else ""
            raise _Refused(grpc.StatusCode.PERMISSION_DENIED, f"this worker serves {own.model_config.model}{root}; "
                                                              f"refusing to load {config.model_config.model}")
        # A worker with --allowed-model-root loads what its scheduler asks; any other must agree
        # with it on what both read.
        if self.allowed_model_root is None:
            mismatches = config_mismatches(own, config, SHARED_PARTS)
            if mismatches:
                raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                               config_mismatch_message(mismatches, "this worker's", "the scheduler's"))
        draft = config.speculative_config.model
        if draft and not (draft == own.speculative_config.model or self._model_allowed(draft)):
            raise _Refused(grpc.StatusCode.PERMISSION_DENIED,
                           f"this worker may not load draft model {draft} (start it with --speculative-config "
                           "naming that model, or with --allowed-model-root above it)")
        try:
            VllmConfig.from_proto(config)  # every configuration passes the same checks
        except ValueError as e:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"LoadModel.config: {e}") from None
        return merged

    async def LoadModel(self, request: pb.LoadModelRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        try:
            merged = self._merged(request)
        except _Refused as e:
            await context.abort(e.code, e.message)
        try:
            return await self._run(self.worker.load_model, merged)
        except MemoryBudgetError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"LoadModel: {e}")
        except (FileNotFoundError, ValueError, NotImplementedError, KeyError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot load model: {e}")

    async def GetKVCapacity(self, request: pb.KVCapacityRequest, context) -> pb.KVCapacity:
        if self.worker.runner is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "LoadModel must be called first")
        if request.block_size < 1 or request.kv_cache_memory_bytes < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "need block_size >= 1 and a non-negative budget")
        return await self._run(self.worker.get_kv_capacity, request)

    async def InitKVCache(self, request: pb.InitKVCacheRequest, context) -> pb.Empty:
        runner = self.worker.runner
        if runner is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "LoadModel must be called first")
        if request.num_blocks < 2 or request.block_size < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "need num_blocks >= 2 and block_size >= 1")
        # The persistent batch is allocated with the cache (its block tables depend on block_size).
        wanted = (request.num_blocks * runner.kv_bytes_per_block(request.block_size)
                  + runner.batch_state_bytes(runner.max_num_seqs, request.block_size))
        budget = runner.max_kv_cache_bytes()
        if wanted > budget:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"a KV cache of {request.num_blocks} blocks of {request.block_size} tokens and the "
                                f"batch state of {runner.max_num_seqs} sequences need {wanted} bytes; this worker "
                                f"can hold at most {budget}")
        return await self._run(self.worker.init_kv_cache, request)

    async def Execute(self, request_iterator, context):
        if self.worker.runner is None or self.worker.runner.input_batch is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "LoadModel and InitKVCache must come first")
        # A new scheduler stream starts from an empty batch (on the compute thread: a step of
        # an abandoned stream may still be running there).
        await self._run(self.worker.reset_batch)
        async for so in request_iterator:
            try:
                out = await self._run(self.worker.execute, so)
                if out is not None:  # None: the step waits for its grammar bitmask (the next message)
                    yield out
            except InvalidStep as e:  # nothing applied; the sender is at fault (the scheduler: an engine fault)
                logger.error("step %d refused: %s", so.step_id, e)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except Exception as e:  # report, keep serving: the scheduler fails the affected requests
                logger.error("step %d failed: %s", so.step_id, traceback.format_exc())
                await self._run(self.worker.reset_batch)
                yield pb.ModelRunnerOutput(step_id=so.step_id, error=f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS])

    async def FetchKV(self, request: pb.KVFetchRequest, context):
        """A consumer's worker fetches a segment this (producer) worker saved (GrpcConnector)."""
        try:
            chunks = serve_segment(self.worker.kv_connector, request.handle)
            first = next(chunks, None)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no KV segment {request.handle[:80]!r} here (expired, "
                                                           "fetched already, or never saved)")
        if first is not None:
            yield first
        for chunk in chunks:
            yield chunk

    async def Health(self, request: pb.Empty, context) -> pb.HealthResponse:
        info = self.worker.info
        if info is None:
            return pb.HealthResponse(ok=True, detail="no model loaded")
        return pb.HealthResponse(ok=True, detail=f"model {info.model} loaded ({info.dtype} on {info.device}, "
                                                 f"attention backend {info.attention_backend})")


async def serve_worker(host: str, port: int, own: pb.LoadModelRequest, device: str | None = None,
                       preload: bool = True, token: str | None = None,
                       allowed_model_root: str | None = None) -> None:
    logger.setLevel(logging.INFO)  # the weight loads and the attention backend chosen belong in the log
    servicer = WorkerServicer(own, device, allowed_model_root, token)
    if preload:
        await servicer.preload()
    # Steps come within the scheduler's step budget, whatever its configuration (message_limits.py).
    server = grpc_utils.server(WORKER_RECEIVE_BYTES, server_interceptors(token))
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    grpc_utils.bind_or_fail(server, host, port, "worker")
    await server.start()
    logger.info("worker serving on %s:%d%s", host, port, " (internal token required)" if token else "")
    await grpc_utils.serve_until_cancelled(server)
