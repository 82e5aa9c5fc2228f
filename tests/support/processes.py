"""Processes the tests start: free ports, a throwaway redis-server, stopping a process, busy
cores for fault tests on a loaded machine."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

from support import suite_processes


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(port: int, password: str | None = None) -> subprocess.Popen:
    """A throwaway redis-server on 127.0.0.1:`port`, answering PING when this returns; with
    `password`, it wants it (`requirepass`, given on stdin as `myvllm serve` does)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail(
            "redis-server not found on PATH: run `make setup` (it apt-get installs redis-server)", pytrace=False
        )
    import redis

    proc = subprocess.Popen(
        [exe, "-", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--daemonize", "no"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    suite_processes.register(proc.pid)  # its environment reads empty: found by pid, not by the run's tag
    proc.stdin.write(f"requirepass {password}\n".encode() if password else b"")
    proc.stdin.close()
    url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{port}"
    deadline = time.monotonic() + 15
    while True:
        if proc.poll() is not None:
            pytest.fail(f"redis-server exited early with code {proc.returncode} (port {port})", pytrace=False)
        try:
            client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
            if client.ping():
                client.close()
                return proc
        except redis.exceptions.ConnectionError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"redis-server on port {port} did not answer PING within 15 s", pytrace=False)
        time.sleep(0.05)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 5 s."""
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


class CpuHogs:
    """One busy process per core (`yes > /dev/null`): a fault test's timing as on a loaded
    machine (a test run beside it), where restarts, model loads and migrations all take longer."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        if not self.procs:
            self.procs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(os.cpu_count() or 1)]

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()
        self.procs = []
