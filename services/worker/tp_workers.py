"""Tensor-parallel ranks as local processes, behind the `Worker` interface.

The offline `LLM` talks to one object with `load_model / get_kv_capacity / init_kv_cache /
execute`. With tensor_parallel_size T this is that object: rank 0 runs in this process,
ranks 1..T-1 in child processes (spawned: a forked torch is not safe), and every call is
mirrored to all of them, since each rank must take part in the same collectives in the same
order. Protos cross the pipe serialised; only rank 0's answer is returned. A child that dies
or fails turns into a RuntimeError naming its rank (the LLM reports it, never hangs on it:
the gloo group itself times out after MYVLLM_TP_TIMEOUT_S).
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection

from services.common.proto import myvllm_pb2 as pb
from services.worker.parallel import RendezvousStore, destroy_tensor_parallel
from services.worker.worker import Worker

# Each call's proto type, so the child can parse what the pipe carries (None: no argument).
_REQUEST_TYPES = {
    "load_model": pb.LoadModelRequest,
    "get_kv_capacity": pb.KVCapacityRequest,
    "init_kv_cache": pb.InitKVCacheRequest,
    "execute": pb.SchedulerOutput,
    "reset_batch": None,
}


def _rank_main(conn: Connection, device: str | None) -> None:
    """A child rank: apply each mirrored call to its own Worker until told to stop."""
    worker = Worker(device)
    while True:
        try:
            method, payload = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return  # the parent went away
        if method == "stop":
            return
        try:
            request_type = _REQUEST_TYPES[method]
            call = getattr(worker, method)
            call() if request_type is None else call(request_type.FromString(payload))
            conn.send(None)
        except Exception as e:  # reported to rank 0, which raises it
            conn.send(f"{type(e).__name__}: {e}")


class TensorParallelWorkers:
    """`Worker`'s calls over T ranks: rank 0 here, the others in child processes."""

    def __init__(self, tensor_parallel_size: int, device: str | None = None) -> None:
        self.size = tensor_parallel_size
        self.rendezvous = RendezvousStore()
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        for _ in range(1, tensor_parallel_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(child, device), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self.local = Worker(device)

    @property
    def runner(self):
        return self.local.runner

    def _mirror(self, method: str, requests: list, local_request):
        """Send each child its request, run rank 0's, then collect every child's answer."""
        for rank, (conn, request) in enumerate(zip(self.conns, requests, strict=True), start=1):
            try:
                conn.send((method, b"" if request is None else request.SerializeToString()))
            except (BrokenPipeError, OSError):
                raise RuntimeError(f"tensor-parallel rank {rank} is gone") from None
        try:
            call = getattr(self.local, method)
            result = call() if local_request is None else call(local_request)
        except BaseException:
            # The children may be blocked in a collective rank 0 never reached: they cannot
            # be trusted to answer, and the group is broken anyway.
            self.close(graceful=False)
            raise
        errors = []
        for rank, conn in enumerate(self.conns, start=1):
            try:
                error = conn.recv()
            except (EOFError, OSError):
                error = f"process exited (code {self.procs[rank - 1].exitcode})"
            if error is not None:
                errors.append(f"rank {rank}: {error}")
        if errors:
            raise RuntimeError(f"tensor-parallel {method} failed on {'; '.join(errors)}")
        return result

    def load_model(self, request: pb.LoadModelRequest) -> pb.ModelInfo:
        per_rank, init_method = [], self.rendezvous.next_init_method()
        for rank in range(self.size):
            r = pb.LoadModelRequest()
            r.CopyFrom(request)
            r.tensor_parallel_rank, r.tensor_parallel_size = rank, self.size
            r.distributed_init_method = init_method
            per_rank.append(r)
        return self._mirror("load_model", per_rank[1:], per_rank[0])

    def get_kv_capacity(self, request: pb.KVCapacityRequest) -> pb.KVCapacity:
        # Every rank holds the same share of the KV heads, so rank 0's answer is everyone's.
        return self._mirror("get_kv_capacity", [request] * len(self.conns), request)

    def init_kv_cache(self, request: pb.InitKVCacheRequest) -> pb.Empty:
        return self._mirror("init_kv_cache", [request] * len(self.conns), request)

    def execute(self, so: pb.SchedulerOutput) -> pb.ModelRunnerOutput | None:
        return self._mirror("execute", [so] * len(self.conns), so)

    def reset_batch(self) -> None:
        """Every rank forgets every request (after a failed step)."""
        self._mirror("reset_batch", [None] * len(self.conns), None)

    def close(self, graceful: bool = True) -> None:
        for conn in self.conns if graceful else ():
            try:
                conn.send(("stop", b""))
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=10 if graceful else 0)
            if proc.is_alive():
                proc.kill()
        self.conns, self.procs = [], []
        destroy_tensor_parallel()  # rank 0's side of the group lives in this process


def make_workers(tensor_parallel_size: int, device: str | None = None) -> Worker | TensorParallelWorkers:
    """One in-process Worker, or T ranks when tensor parallelism is asked for."""
    if tensor_parallel_size > 1:
        return TensorParallelWorkers(tensor_parallel_size, device)
    return Worker(device)

