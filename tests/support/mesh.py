"""Start the real mesh for tests: `Mesh` (`myvllm serve`: worker, scheduler, gateway as
processes) or one `Replica` (worker + scheduler processes) of a data-parallel deployment.

`serve` is started the way a background job of a non-interactive shell starts it (SIGINT
ignored, its own process group), so that no test depends on what pytest inherited and every
stop shows that Ctrl-C still stops it. Whatever path a stop takes, every process the mesh
started (found by its owner tag, wherever it went) is gone when `stop` returns.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from support import suite_processes
from support.processes import free_port

REPO = Path(__file__).resolve().parents[2]
# The meshes started since the current test began (conftest attaches their output to its report
# when it fails: what the services logged is what explains a fault or a timing failure).
STARTED: list[Mesh] = []


class Mesh:
    def __init__(self, extra_args: list[str] | None = None, env: dict[str, str] | None = None,
                 one_replica: bool = True) -> None:
        """`one_replica`: serve picks a known scheduler port (`scheduler_port`); off for
        --data-parallel-size > 1, where serve picks every replica's ports itself."""
        self.port = free_port()
        self.scheduler_port = free_port() if one_replica else None
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "services.entrypoints.cli", "serve", "--port", str(self.port),
               *(["--scheduler-port", str(self.scheduler_port)] if one_replica else []), *(extra_args or [])]
        if "--dtype" not in cmd:
            cmd += ["--dtype", "float32"]  # outputs are compared with fp32 references, on any CPU
        self.owner, proc_env = suite_processes.owner_env(dict(os.environ, PYTHONPATH=str(REPO), **(env or {})))
        self.leftovers: list[str] = []  # processes still alive after serve exited (killed by stop)
        self.output: list[str] = []  # everything serve and its services print
        STARTED.append(self)
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=proc_env, start_new_session=True, preexec_fn=_ignore_sigint)
        try:
            self._wait_for_banner()
        except BaseException:
            self.kill()
            raise

    def _wait_for_banner(self) -> None:
        self.banner: list[str] = []
        # self.output is read on by a thread once the banner is in (an unread pipe would fill and
        # block them).
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"myvllm serve exited early: {''.join(self.banner)[-3000:]}")
            self.banner.append(line)
            self.output.append(line)
            if line.startswith("Press Ctrl-C"):
                self._reader = threading.Thread(target=self._read_output, daemon=True)
                self._reader.start()
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
        """Ctrl-C to serve; its exit code (-9: it had to be killed). Every process of the mesh is
        gone afterwards; the ones that outlived serve are named in `leftovers`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = -9
        deadline = time.monotonic() + 10  # services told to stop may still be exiting
        if code != -9 and getattr(self, "_reader", None) is not None:
            self._reader.join(timeout=10)  # the last lines (the services' exits) are in `output`
        while suite_processes.owned_processes(self.owner) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.leftovers = [suite_processes.describe(pid) for pid in suite_processes.owned_processes(self.owner)]
        self.kill()
        return code

    def kill(self) -> None:
        """Stop every process of the mesh (serve's group, then whatever carries its owner tag)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        suite_processes.stop_processes(lambda: suite_processes.owned_processes(self.owner))
        self.proc.wait()


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
