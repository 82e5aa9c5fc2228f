"""Start the real mesh for tests: `Mesh` (`myvllm serve`: worker, scheduler, gateway as
processes) or one `Replica` (worker + scheduler processes) of a data-parallel deployment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from conftest import free_port

REPO = Path(__file__).resolve().parents[1]


class Mesh:
    def __init__(self, extra_args: list[str] | None = None, env: dict[str, str] | None = None,
                 one_replica: bool = True) -> None:
        """`one_replica`: serve picks a known scheduler port (`scheduler_port`); off for
        --data-parallel-size > 1, where serve picks every replica's ports itself."""
        self.port = free_port()
        self.scheduler_port = free_port() if one_replica else None
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "services.cli", "serve", "--port", str(self.port),
               *(["--scheduler-port", str(self.scheduler_port)] if one_replica else []), *(extra_args or [])]
        if "--dtype" not in cmd:
            cmd += ["--dtype", "float32"]  # outputs are compared with fp32 references, on any CPU
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})))
        self.banner: list[str] = []
        # Everything serve and its services print, read on by a thread once the banner is in
        # (an unread pipe would fill and block them).
        self.output: list[str] = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"myvllm serve exited early: {''.join(self.banner)[-3000:]}")
            self.banner.append(line)
            self.output.append(line)
            if line.startswith("Press Ctrl-C"):
                threading.Thread(target=self._read_output, daemon=True).start()
                return
        raise RuntimeError("myvllm serve did not come up")

    def _read_output(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)

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
