"""One engine replica as real processes (a worker and a scheduler) for tests: start, wait
until healthy, kill or stop the worker (or the scheduler) and start it again on the same port."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from services.client.grpc_client import Client
from services.common.auth import TOKEN_ENV
from services.common.proto import myvllm_pb2 as pb
from services.common.redis_registry import REDIS_URL_ENV
from support import suite_processes
from support.processes import free_port

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "services.entrypoints.cli"]
# Small and quick: a short context, a small KV cache, one thread per process (two cores).
WORKER_ARGS = ("--max-model-len", "1024", "--dtype", "float32")  # fp32: outputs compared across CPUs


def scheduler_args(max_num_seqs: int = 8, *extra: str) -> tuple[str, ...]:
    return ("--max-num-seqs", str(max_num_seqs), "--kv-cache-memory", str(64 << 20), *extra)


class Replica:
    """A worker and its scheduler on loopback ports, each logging to its own file."""

    def __init__(self, model_dir: str, redis_url: str | None = None, max_num_seqs: int = 8, token: str | None = None,
                 worker_args: tuple[str, ...] = WORKER_ARGS, extra_scheduler_args: tuple[str, ...] = ()) -> None:
        self.model_dir = model_dir
        self.token = token
        self.worker_args = worker_args
        self.worker_port, self.scheduler_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.scheduler_port}"
        self.worker_address = f"127.0.0.1:{self.worker_port}"
        self.owner, self.env = suite_processes.owner_env(dict(os.environ, PYTHONPATH=str(REPO), MYVLLM_NUM_THREADS="1"))
        self.env.pop(TOKEN_ENV, None)
        self.env.pop(REDIS_URL_ENV, None)  # --redis alone says where it publishes
        if token:
            self.env[TOKEN_ENV] = token
        self.log_dir = Path(tempfile.mkdtemp(prefix="myvllm-replica-"))
        self.worker_starts = 0
        self._scheduler_args = [
            "scheduler", "--host", "127.0.0.1", "--port", str(self.scheduler_port), "--workers", self.worker_address,
            *(["--redis", redis_url] if redis_url else []), *scheduler_args(max_num_seqs, *extra_scheduler_args)]
        self.scheduler_starts = 0
        try:
            self.worker = self.start_worker()
            self.scheduler = self.start_scheduler()
        except BaseException:
            self.stop()
            raise

    def start_scheduler(self) -> subprocess.Popen:
        """Start the scheduler on this replica's scheduler port (again, after a kill); its log
        is scheduler.log, then scheduler-N.log for the N-th start."""
        self.scheduler_starts += 1
        name = "scheduler" if self.scheduler_starts == 1 else f"scheduler-{self.scheduler_starts}"
        self.scheduler = self._spawn(name, self._scheduler_args)
        return self.scheduler

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it open
        try:
            # Its own process group: a signal meant for one process never reaches the others.
            return subprocess.Popen([*CLI, *args], cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        finally:
            log.close()

    def start_worker(self) -> subprocess.Popen:
        """Start a worker on this replica's worker port (again, after a kill); its log is
        worker-N.log for the N-th start."""
        self.worker_starts += 1
        self.worker = self._spawn(f"worker-{self.worker_starts}", [
            "worker", "--host", "127.0.0.1", "--port", str(self.worker_port), "--model", self.model_dir,
            *self.worker_args])
        return self.worker

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def log_tail(self) -> str:
        """The end of every process's log, for assertion messages."""
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-1500:]}"
                         for path in sorted(self.log_dir.glob("*.log")))

    def client(self, timeout: float = 5.0) -> Client:
        return Client(self.address, timeout=timeout, token=self.token)

    def wait_healthy(self, healthy: bool = True, timeout_s: float = 180) -> None:
        """Until the scheduler's Health says `healthy` (the processes must stay alive)."""
        deadline = time.monotonic() + timeout_s
        with self.client(timeout=1.0) as client:
            while client.health() != healthy:
                assert self.scheduler.poll() is None, f"scheduler exited: {self.log_tail()}"
                if healthy:
                    assert self.worker.poll() is None, f"worker exited: {self.log_tail()}"
                assert time.monotonic() < deadline, f"scheduler health never became {healthy}"
                time.sleep(0.2)

    wait_ready = wait_healthy

    def stats(self) -> pb.Stats:
        with self.client() as client:
            return client.get_stats()

    def num_steps(self) -> int:
        return self.stats().num_steps

    def kill_worker(self, sig: int = signal.SIGKILL) -> None:
        self.worker.send_signal(sig)
        if sig == signal.SIGKILL:
            self.worker.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM every process of this replica (SIGCONT first: a stopped process cannot act on
        it), SIGKILL what is left after 15 s; safe to call twice."""
        suite_processes.stop_processes(lambda: suite_processes.owned_processes(self.owner), grace_s=15)
        for proc in (getattr(self, "scheduler", None), getattr(self, "worker", None)):
            if proc is not None:
                proc.wait()
        shutil.rmtree(self.log_dir, ignore_errors=True)
