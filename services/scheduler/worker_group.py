"""The tensor- and pipeline-parallel ranks of one engine, behind `WorkerLink`'s interface.

The scheduler stays the only owner of KV block accounting: every rank holds the same block
ids for its own shard of the KV heads and its stage's layers, so every step (the same
`SchedulerOutput`) goes to every rank. The workers are listed stage-major (T ranks of stage
0, then stage 1, ...); TP rank 0 of the last stage samples, and its answer is the step's. The
other ranks' answers are read too, so their streams keep flowing and a rank that fails or
dies is noticed at once (any rank's fault is the engine's fault: the ranks share every
collective and every stage-to-stage transfer).

Set-up (services/engine/worker_setup.py drives it): the ranks rendezvous at a store this
scheduler hosts (services/common/rendezvous.py), each LoadModel naming its TP rank, its stage
and this set-up's generation; the KV cache gets the blocks that fit on the fullest rank.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from services.common.proto import myvllm_pb2 as pb
from services.common.ranks import fullest_rank_capacity, output_rank, per_rank_load_requests
from services.scheduler.worker_link import WorkerLink


async def _all(awaitables: list[Awaitable]) -> list:
    """Await all; on the first failure cancel the rest (a rank blocked in a rendezvous or a
    stream read whose peer failed would otherwise wait out its deadline) and raise it."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


class WorkerGroup:
    """The engine's ranks over gRPC: the step loop's `WorkerHandle` (services/engine/step_loop.py)."""

    def __init__(self, links: list[WorkerLink], tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 rendezvous_host: str = "127.0.0.1", advertise_host: str | None = None,
                 group_init_method: str | None = None, data_parallel_rank: int = 0) -> None:
        """`group_init_method`: a data-parallel expert-parallel group's rendezvous, shared with the
        other engines' ranks (this engine is DP rank `data_parallel_rank`); else this scheduler
        hosts its ranks' own."""
        if len(links) != tensor_parallel_size * pipeline_parallel_size:
            raise ValueError(f"{len(links)} worker address(es) for tensor_parallel_size={tensor_parallel_size} x "
                             f"pipeline_parallel_size={pipeline_parallel_size} ranks: give one address per rank "
                             "(--workers, stage-major) and the same --tensor-parallel-size / "
                             "--pipeline-parallel-size as the workers")
        self.links = links
        self.tp_size, self.pp_size = tensor_parallel_size, pipeline_parallel_size
        self.output_index = output_rank(self.tp_size, self.pp_size)
        self.address = ",".join(link.address for link in links)
        self.rendezvous = None
        self.group_init_method, self.data_parallel_rank = group_init_method, data_parallel_rank
        if len(links) > 1 and group_init_method is None:
            # torch only where there are ranks to join: a one-worker scheduler never imports it.
            from services.common.rendezvous import RendezvousStore

            self.rendezvous = RendezvousStore(rendezvous_host, advertise_host=advertise_host)

    async def connect(self, timeout: float) -> None:
        await _all([link.connect(timeout) for link in self.links])

    # ------------------------------------------------------------ set-up (engine/worker_setup.py)

    async def load_model(self, request: pb.LoadModelRequest) -> pb.ModelInfo:
        """Every rank loads its part; the answers agree but for the rank fields: rank 0's stands."""
        init_method = self.group_init_method or (self.rendezvous.next_init_method() if self.rendezvous else "")
        requests = per_rank_load_requests(request, init_method, self.data_parallel_rank)  # T x P, as the links
        return (await _all([link.load_model(r) for link, r in zip(self.links, requests, strict=True)]))[0]

    async def get_kv_capacity(self, request: pb.KVCapacityRequest) -> pb.KVCapacity:
        return fullest_rank_capacity(await _all([link.get_kv_capacity(request) for link in self.links]))

    async def init_kv_cache(self, request: pb.InitKVCacheRequest) -> None:
        await _all([link.init_kv_cache(request) for link in self.links])

    # ------------------------------------------------------------ the step loop's WorkerHandle

    async def submit(self, so: pb.SchedulerOutput) -> None:
        await _all([link.send(so) for link in self.links])

    async def collect(self) -> pb.ModelRunnerOutput:
        return (await _all([link.receive() for link in self.links]))[self.output_index]

    async def probe(self) -> None:
        await _all([link.probe() for link in self.links])

    async def reset(self) -> None:
        for link in self.links:
            link.reset()
