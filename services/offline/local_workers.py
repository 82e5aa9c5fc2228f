"""The offline `LLM`'s ranks as the step loop's `WorkerHandle` (services/engine/step_loop.py) and
as the set-up's `WorkerSetup` (services/engine/worker_setup.py): one
in-process `Worker`, or T x P ranks (rank 0 here, the rest spawned: services/worker/rank_workers.py).

Steps run on one compute thread when more than one is in flight (async scheduling: the caller
schedules step N+1 while the thread computes step N), else right here. Pipeline ranks take a
step with `submit` (rank 0's part runs now) and answer, in order, with `collect`. A step that
waits for its grammar bitmask answers None; its follow-up message carries the answer.
"""

from __future__ import annotations

import asyncio
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from services.common.proto import myvllm_pb2 as pb
from services.worker.rank_workers import ParallelWorkers
from services.worker.worker import Worker


class LocalWorkers:
    """`threaded`: every call, set-up included, runs on the compute thread (the engines of a
    data-parallel group set up and step together, so none may block the others' event loop)."""

    def __init__(self, workers: Worker | ParallelWorkers, pipelined: bool, threaded: bool = False) -> None:
        self.workers = workers
        self.pipelined = pipelined
        self._compute: ThreadPoolExecutor | None = None
        if threaded:
            self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llm-compute")
        self.threaded = threaded
        # Per submitted message, in order: a Future (the compute thread's), None (a pipeline step,
        # collected from the ranks), or the answer itself (a step run here).
        self._pending: deque[Future | pb.ModelRunnerOutput | None] = deque()

    async def _call(self, method, *args):
        if self.threaded:
            return await asyncio.wrap_future(self._compute.submit(method, *args))
        return method(*args)

    # ------------------------------------------------------------ set-up (engine/worker_setup.py)

    async def load_model(self, request: pb.LoadModelRequest) -> pb.ModelInfo:
        return await self._call(self.workers.load_model, request)

    async def get_kv_capacity(self, request: pb.KVCapacityRequest) -> pb.KVCapacity:
        return await self._call(self.workers.get_kv_capacity, request)

    async def init_kv_cache(self, request: pb.InitKVCacheRequest) -> None:
        await self._call(self.workers.init_kv_cache, request)

    # ------------------------------------------------------------ the step loop's WorkerHandle

    def set_steps_in_flight(self, steps_in_flight: int) -> None:
        """Known once the engine is configured for the loaded model (async scheduling depends on
        its device): more than one step in flight runs steps on a compute thread."""
        if steps_in_flight > 1 and not self.pipelined and self._compute is None:
            self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llm-compute")

    async def submit(self, so: pb.SchedulerOutput) -> None:
        if self.pipelined:
            self.workers.submit(so)
            self._pending.append(None)
        elif self._compute is not None:
            self._pending.append(self._compute.submit(self.workers.execute, so))
        else:
            self._pending.append(self.workers.execute(so))

    async def collect(self) -> pb.ModelRunnerOutput:
        while True:
            if not self._pending:
                raise RuntimeError("no step to collect")
            entry = self._pending.popleft()
            if entry is None:
                answer = self.workers.collect()
            elif isinstance(entry, Future):
                answer = await asyncio.wrap_future(entry)
            else:
                answer = entry
            if answer is not None:  # (None: the step waits for its bitmask, sent as the next message)
                return answer

    async def probe(self) -> None:
        """Nothing to probe: a failed rank raises in the step that needs it."""

    def drain(self) -> bool:
        """Let the ranks finish what was submitted before anyone touches their batch (nobody
        reads those answers); whether any of them failed."""
        failed = False
        while self._pending:
            entry = self._pending.popleft()
            try:
                if entry is None:
                    self.workers.collect()
                elif isinstance(entry, Future):
                    entry.result()
            except Exception:  # noqa: BLE001 - any failure means: reset
                failed = True
        return failed

    async def reset(self) -> None:
        self.drain()
        await self._call(self.workers.reset_batch)

    def close(self) -> None:
        self.drain()
        if self._compute is not None:
            self._compute.shutdown(wait=True)
