"""Start the real mesh for tests: `Mesh` (`myvllm serve`: worker, scheduler, gateway as
processes) or one `Replica` (worker + scheduler processes) of a data-parallel deployment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from conftest import free_port

from services.common.proto import myvllm_pb2 as pb
from services.sdk.client import Client

REPO = Path(__file__).resolve().parents[1]


class Mesh:
    def __init__(self, extra_args: list[str] | None = None) -> None:
        self.port = free_port()
        self.scheduler_port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "services.cli", "serve", "--port", str(self.port),
               "--scheduler-port", str(self.scheduler_port), *(extra_args or [])]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, PYTHONPATH=str(REPO)))
        self.banner: list[str] = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"myvllm serve exited early: {''.join(self.banner)[-3000:]}")
            self.banner.append(line)
            if line.startswith("Press Ctrl-C"):
                return
        raise RuntimeError("myvllm serve did not come up")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.base_url}/metrics", timeout=5).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                if "{" in name and "_bucket" not in name:
                    name = name.split("{")[0]  # gauges/counters carry only the model_name label
                values[name] = float(value)
        return values

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


class Replica:
    """One engine replica as processes: a worker and a scheduler publishing to Redis."""

    def __init__(self, model_dir: str, redis_url: str | None, max_num_seqs: int = 8) -> None:
        self.worker_port, self.scheduler_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.scheduler_port}"
        env = dict(os.environ, PYTHONPATH=str(REPO), MYVLLM_NUM_THREADS="1")
        cli = [sys.executable, "-m", "services.cli"]
        engine = ["--max-num-seqs", str(max_num_seqs), "--max-model-len", "1024", "--kv-cache-memory", str(64 << 20)]
        redis = ["--redis", redis_url] if redis_url else []
        # A file, not a pipe: a chatty process (warnings during fault tests) must never block on it.
        self.log = tempfile.TemporaryFile()
        self.worker = subprocess.Popen(
            [*cli, "worker", "--host", "127.0.0.1", "--port", str(self.worker_port), "--model", model_dir, *engine],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=self.log)
        self.scheduler = subprocess.Popen(
            [*cli, "scheduler", "--host", "127.0.0.1", "--port", str(self.scheduler_port),
             "--workers", f"127.0.0.1:{self.worker_port}", *redis, *engine],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=self.log)

    def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        with Client(self.address, timeout=1.0) as client:
            while not client.health():
                for proc in (self.worker, self.scheduler):
                    assert proc.poll() is None, f"replica process exited: {self.log_tail()}"
                assert time.monotonic() < deadline, "replica never became healthy"
                time.sleep(0.5)

    def log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-2000:]

    def stats(self) -> pb.Stats:
        with Client(self.address, timeout=5.0) as client:
            return client.get_stats()

    def num_steps(self) -> int:
        return self.stats().num_steps

    def stop(self) -> None:
        for proc in (self.scheduler, self.worker):
            if proc.poll() is None:
                proc.terminate()
        for proc in (self.scheduler, self.worker):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
