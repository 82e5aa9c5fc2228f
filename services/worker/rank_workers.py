"""An engine's tensor- and pipeline-parallel ranks as local processes, behind the `Worker` interface.

The offline `LLM` talks to one object with `load_model / get_kv_capacity / init_kv_cache /
execute`. With T x P ranks this is that object: rank 0 (TP rank 0 of the first stage) runs in
this process, ranks 1..T*P-1 in child processes (spawned: a forked torch is not safe), and every
call is mirrored to all of them, since each rank must take part in the same collectives and
stage-to-stage transfers in the same order. Protos cross the pipes serialised.

Pipelining: `submit(step)` hands a step to every rank and runs rank 0's part of it here (the
first stage, which only sends its hidden states on); `collect()` waits for the oldest submitted
step's answers. The LLM submits P steps before it collects the first, so while the last stage
computes step N the first already computes step N+1. Each child has a sender thread, so a
submit never blocks on a child that is still busy (and whose answer pipe the parent is not yet
reading). The step's answer comes from TP rank 0 of the last stage; a child that dies or fails
turns into a RuntimeError naming its rank (the LLM reports it, never hangs on it: the gloo
group itself times out after MYVLLM_TP_TIMEOUT_S). After any rank's failure the group cannot be
trusted (some ranks may sit in a collective the others never reach): every child is stopped,
and `reset_batch` starts fresh ones and sets them up again as the last load did.

Data-parallel expert parallelism (an offline `LLM` with data_parallel_size D): D of these, one
per engine, share one rendezvous store and one process group of D x T ranks; only engine 0's
rank 0 runs in this process (`local`), the other engines' ranks are all children.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
from collections import deque
from multiprocessing.connection import Connection

from services.common.proto import myvllm_pb2 as pb
from services.common.ranks import fullest_rank_capacity, output_rank, per_rank_load_requests
from services.common.rendezvous import RendezvousStore
from services.worker.parallel import destroy_parallel
from services.worker.worker import Worker

# Each call's proto types (request, answer), so both ends can parse what the pipes carry.
_TYPES = {
    "load_model": (pb.LoadModelRequest, pb.ModelInfo),
    "get_kv_capacity": (pb.KVCapacityRequest, pb.KVCapacity),
    "init_kv_cache": (pb.InitKVCacheRequest, pb.Empty),
    "execute": (pb.SchedulerOutput, pb.ModelRunnerOutput),
    "reset_batch": (None, None),
}


def _rank_main(conn: Connection, device: str | None) -> None:
    """A child rank: apply each mirrored call to its own Worker until told to stop; answer
    (None, serialized result, or None for no result) or (error text, None)."""
    worker = Worker(device)
    while True:
        try:
            method, payload = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return  # the parent went away
        if method == "stop":
            return
        try:
            request_type, _ = _TYPES[method]
            call = getattr(worker, method)
            result = call() if request_type is None else call(request_type.FromString(payload))
            conn.send((None, None if result is None else result.SerializeToString()))
        except Exception as e:  # reported to the parent, which raises it
            conn.send((f"{type(e).__name__}: {e}", None))


class _Child:
    """One child rank: its process, its pipe, and a thread that sends it calls in order."""

    def __init__(self, ctx, device: str | None) -> None:
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_rank_main, args=(child, device), daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.send_failed = False
        threading.Thread(target=self._send_loop, daemon=True).start()

    def _send_loop(self) -> None:
        while (message := self.outbox.get()) is not None:
            try:
                self.conn.send(message)
            except (BrokenPipeError, OSError):
                self.send_failed = True  # the answer read will report the exit
                return

    def send(self, method: str, request) -> None:
        self.outbox.put((method, b"" if request is None else request.SerializeToString()))

    def receive(self) -> tuple[str | None, bytes | None]:
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(timeout=1)
            return f"process exited (code {self.proc.exitcode})", None

    def stop(self, graceful: bool) -> None:
        if graceful and not self.send_failed:
            self.outbox.put(("stop", b""))
        self.outbox.put(None)
        self.proc.join(timeout=10 if graceful else 0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        self.conn.close()


class ParallelWorkers:
    """`Worker`'s calls over T x P ranks: rank 0 here (unless `local` is False), the others in
    child processes."""

    def __init__(self, tensor_parallel_size: int, pipeline_parallel_size: int = 1, device: str | None = None,
                 data_parallel_rank: int = 0, rendezvous: RendezvousStore | None = None, local: bool = True) -> None:
        self.tp_size, self.pp_size = tensor_parallel_size, pipeline_parallel_size
        self.size = tensor_parallel_size * pipeline_parallel_size
        self.output_rank = output_rank(tensor_parallel_size, pipeline_parallel_size)
        self.device = device
        self.data_parallel_rank = data_parallel_rank
        # Shared by the engines of a data-parallel group: each set-up is the same generation on all.
        self.rendezvous = rendezvous or RendezvousStore()
        self._generation = 0
        self.first_child_rank = 1 if local else 0
        self.children: list[_Child] = []
        self._spawn()
        self.local = Worker(device) if local else None
        # Rank 0's answers of submitted steps whose other answers are not collected yet.
        self._submitted: deque[pb.ModelRunnerOutput | None] = deque()
        # The last set-up, replayed on fresh children after a failure.
        self._load_request: pb.LoadModelRequest | None = None
        self._kv_request: pb.InitKVCacheRequest | None = None
        self.broken = False

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        self.children = [_Child(ctx, self.device) for _ in range(self.first_child_rank, self.size)]

    @property
    def procs(self) -> list[mp.process.BaseProcess]:
        return [child.proc for child in self.children]

    @property
    def runner(self):
        return self.local.runner if self.local is not None else None

    def _start(self, method: str, requests: list):
        """Send each child its request (`requests`: one per rank), then run rank 0's here (the
        children start on theirs at once)."""
        local_request = requests[0]
        for child, request in zip(self.children, requests[self.first_child_rank:], strict=True):
            child.send(method, request)
        if self.local is None:
            return None
        try:
            call = getattr(self.local, method)
            return call() if local_request is None else call(local_request)
        except BaseException:
            # The children may be blocked in a collective rank 0 never reached: they cannot
            # be trusted to answer, and the group is broken anyway.
            self.break_group()
            raise

    def break_group(self) -> None:
        """Stop every child at once (the group cannot be trusted); `reset_batch` starts afresh."""
        self.close(graceful=False)
        self.broken = True

    def stop_children(self) -> None:
        """Kill the child ranks now (a rank of this process blocked in a collective with them
        then fails instead of waiting for the group's timeout); `break_group` follows."""
        for child in self.children:
            child.stop(graceful=False)
        self.children = []

    def _finish(self, method: str) -> list:
        """Every child's answer to its oldest outstanding call, parsed (None for no result)."""
        _, answer_type = _TYPES[method]
        answers, errors = [], []
        for rank, child in enumerate(self.children, start=self.first_child_rank):
            error, payload = child.receive()
            if error is not None:
                errors.append(f"rank {rank}: {error}")
            answers.append(None if payload is None else answer_type.FromString(payload))
        if errors:
            self.break_group()
            raise RuntimeError(f"model-parallel {method} failed on {'; '.join(errors)}")
        return answers

    def _answers(self, local, method: str) -> list:
        """Every rank's answer, in rank order."""
        children = self._finish(method)
        return [local, *children] if self.local is not None else children

    def _mirror(self, method: str, requests: list) -> list:
        """Run one call on every rank and wait for all: the answers of rank 0, 1, ..."""
        return self._answers(self._start(method, requests), method)

    def load_model(self, request: pb.LoadModelRequest) -> pb.ModelInfo:
        parallel = request.config.parallel_config
        if (parallel.tensor_parallel_size, parallel.pipeline_parallel_size) != (self.tp_size, self.pp_size):
            raise ValueError(f"LoadModel asks for {parallel.tensor_parallel_size} x {parallel.pipeline_parallel_size} "
                             f"ranks; these are {self.tp_size} x {self.pp_size}")
        self._load_request = request
        init_method = self.rendezvous.init_method(self._generation)
        self._generation += 1
        return self._mirror("load_model", per_rank_load_requests(request, init_method, self.data_parallel_rank))[0]

    def get_kv_capacity(self, request: pb.KVCapacityRequest) -> pb.KVCapacity:
        return fullest_rank_capacity(self._mirror("get_kv_capacity", [request] * self.size))

    def init_kv_cache(self, request: pb.InitKVCacheRequest) -> pb.Empty:
        self._kv_request = request
        return self._mirror("init_kv_cache", [request] * self.size)[0]

    def submit(self, so: pb.SchedulerOutput) -> None:
        """Start a step on every rank (rank 0's part runs now); `collect` returns its answer."""
        if self.broken:
            raise RuntimeError("model-parallel ranks failed earlier and were not set up again (reset_batch does)")
        self._submitted.append(self._start("execute", [so] * self.size))

    def collect(self) -> pb.ModelRunnerOutput:
        """The oldest submitted step's answer (waits for every rank to finish it)."""
        if self.broken or not self._submitted:
            raise RuntimeError("no step to collect: model-parallel ranks failed, or nothing was submitted")
        return self._answers(self._submitted.popleft(), "execute")[self.output_rank]

    def execute(self, so: pb.SchedulerOutput) -> pb.ModelRunnerOutput | None:
        """The step's answer; None for a step that waits for its grammar bitmask (see Worker.execute)."""
        self.submit(so)
        return self.collect()

    def reset_batch(self) -> None:
        """Every rank forgets every request (after a failed step); after a rank failed, fresh
        children are started and set up as before (a new process group, the same KV size)."""
        if self.broken:
            self._spawn()
            self.broken = False
            self.load_model(self._load_request)
            self.init_kv_cache(self._kv_request)  # an empty batch on every rank
            return
        while self._submitted:  # answers of steps nobody collected come first on the pipes
            self.collect()
        self._mirror("reset_batch", [None] * self.size)

    def close(self, graceful: bool = True) -> None:
        for child in self.children:
            child.stop(graceful)
        self.children = []
        self._submitted.clear()
        if self.local is not None:
            destroy_parallel()  # rank 0's side of the group lives in this process


def make_workers(tensor_parallel_size: int, pipeline_parallel_size: int = 1,
                 device: str | None = None) -> Worker | ParallelWorkers:
    """One in-process Worker, or T x P ranks when model parallelism is asked for."""
    if tensor_parallel_size * pipeline_parallel_size > 1:
        return ParallelWorkers(tensor_parallel_size, pipeline_parallel_size, device)
    return Worker(device)
