"""The scheduler's connection to its worker: set-up calls and the Execute stream, with
deadlines. Whatever goes wrong on the link (the worker died, hung, or failed a step)
surfaces as one exception, `WorkerFault`, so the engine loop has one failure path.
"""

from __future__ import annotations

import asyncio

import grpc

from services.common.auth import token_metadata
from services.common.config import DEFAULT_ENGINE_TIMEOUT_S
from services.common.grpc_utils import SETUP_TIMEOUT_S, UNARY_TIMEOUT_S, StartupError, channel
from services.common.proto import myvllm_pb2 as pb
from services.common.proto import myvllm_pb2_grpc as pb_grpc


class WorkerFault(RuntimeError):
    """The worker failed a step, closed its stream, or gave no answer in time."""


class WorkerLink:
    def __init__(self, address: str, max_receive_bytes: int, token: str | None = None,
                 engine_timeout: float = DEFAULT_ENGINE_TIMEOUT_S) -> None:
        """`max_receive_bytes`: the largest answer to read (message_limits.runner_output_bytes
        of the scheduler's configuration, with a margin)."""
        self.address = address
        self.engine_timeout = engine_timeout
        self.metadata = token_metadata(token)
        self.channel = channel(address, max_receive_bytes)
        self.stub = pb_grpc.WorkerStub(self.channel)
        self.stream: grpc.aio.StreamStreamCall | None = None

    async def connect(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise StartupError(f"scheduler: worker at {self.address} is unreachable") from None

    async def load_model(self, request: pb.LoadModelRequest) -> pb.ModelInfo:
        return await self.stub.LoadModel(request, timeout=SETUP_TIMEOUT_S, metadata=self.metadata,
                                         wait_for_ready=True)

    async def get_kv_capacity(self, request: pb.KVCapacityRequest) -> pb.KVCapacity:
        return await self.stub.GetKVCapacity(request, timeout=UNARY_TIMEOUT_S, metadata=self.metadata)

    async def init_kv_cache(self, request: pb.InitKVCacheRequest) -> None:
        await self.stub.InitKVCache(request, timeout=SETUP_TIMEOUT_S, metadata=self.metadata)

    async def send(self, so: pb.SchedulerOutput) -> None:
        if self.stream is None:
            self.stream = self.stub.Execute(metadata=self.metadata)
        await self._within_timeout(self.stream.write(so), f"step {so.step_id} could not be sent")

    async def receive(self) -> pb.ModelRunnerOutput:
        out = await self._within_timeout(self.stream.read(), "no answer to a step")
        if out is grpc.aio.EOF:
            raise WorkerFault(f"worker at {self.address} closed its Execute stream")
        if out.error:
            raise WorkerFault(f"worker at {self.address} failed step {out.step_id}: {out.error}")
        return out

    async def _within_timeout(self, awaitable, what: str):
        try:
            return await asyncio.wait_for(awaitable, self.engine_timeout)
        except asyncio.TimeoutError:
            raise WorkerFault(f"worker at {self.address}: {what} within {self.engine_timeout:g}s "
                              "(--engine-timeout)") from None
        except grpc.aio.AioRpcError as e:
            # UNAVAILABLE / CANCELLED: the process or its connection went away; anything else (a
            # step it refused as INVALID_ARGUMENT, an INTERNAL error) came from a worker still there.
            gone = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            raise WorkerFault(f"worker at {self.address} {'is gone' if gone else 'failed'} "
                              f"({e.code().name}: {e.details()})") from None
        except asyncio.InvalidStateError:  # writing to a call that already ended
            raise WorkerFault(f"worker at {self.address}: the Execute stream already ended") from None

    async def probe(self) -> None:
        """Check an idle worker: its Execute stream still open, Health answered in time. A
        dead worker is then noticed (and the replica leaves Redis) before the next request."""
        if self.stream is not None and self.stream.done():
            raise WorkerFault(f"worker at {self.address} ended its Execute stream")
        try:
            await self.stub.Health(pb.Empty(), timeout=min(self.engine_timeout, UNARY_TIMEOUT_S),
                                   metadata=self.metadata)
        except grpc.aio.AioRpcError as e:
            raise WorkerFault(f"worker at {self.address} does not answer Health ({e.code().name}: "
                              f"{e.details()})") from None

    def reset(self) -> None:
        """Drop the Execute stream (a fresh one makes the worker start from an empty batch)."""
        if self.stream is not None:
            self.stream.cancel()
        self.stream = None
