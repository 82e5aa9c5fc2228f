"""The processes the test suite starts: found, measured and stopped wherever they went.

Every process pytest starts inherits `RUN_ENV` (set once, in conftest, before any test runs),
so the suite finds its own processes by their environment, even the ones that left the
process tree (a service whose `serve` was killed is re-parented to init) or started a session
of their own. `OWNER_ENV` narrows that to what one helper (a `Mesh`, a `Replica`) started.

- `suite_processes()` / `owned_processes(owner)`: pids, found through /proc.
- `register(pid)`: a process whose environment cannot be read back (redis-server rewrites its
  process title over it, so /proc/PID/environ reads empty) is tracked by pid and start time.
- `stop_processes(pids)`: SIGTERM (and SIGCONT, for a stopped one), then SIGKILL.
- `MemorySampler`: the suite's resident memory once a second (pytest and every process of
  the suite), its peak and the test that was running then.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

RUN_ENV = "MYVLLM_TEST_RUN"
OWNER_ENV = "MYVLLM_TEST_OWNER"


def mark_this_run() -> str:
    """Tag this process's environment (inherited by every child from now on) with a fresh run id."""
    os.environ[RUN_ENV] = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    return os.environ[RUN_ENV]


def owner_env(env: dict[str, str] | None = None) -> tuple[str, dict[str, str]]:
    """(owner id, `env` or os.environ with a fresh OWNER_ENV): what a helper starts its processes with."""
    owner = uuid.uuid4().hex[:12]
    return owner, {**(os.environ if env is None else env), OWNER_ENV: owner}


def processes_with_env(name: str, value: str) -> list[int]:
    """Every live process but this one whose environment has `name=value`."""
    needle = f"{name}={value}".encode()
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone, or not ours to read
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry))
    return found


# Registered pids -> their start time (field 22 of /proc/PID/stat): a reused pid is not ours.
_registered: dict[int, str] = {}


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return None if fields[0] == b"Z" else fields[19].decode()  # a zombie is as good as gone


def alive(pid: int) -> bool:
    """`pid` runs (a zombie does not)."""
    return _start_time(pid) is not None


def register(pid: int) -> None:
    """Count `pid` among the run's processes although its environment cannot be read."""
    start = _start_time(pid)
    if start is not None:
        _registered[pid] = start


def suite_processes() -> list[int]:
    """Every live process (zombies excepted: they have no environment) started by this test run."""
    run = os.environ.get(RUN_ENV)
    found = processes_with_env(RUN_ENV, run) if run else []
    return found + [pid for pid, start in _registered.items() if pid not in found and _start_time(pid) == start]


def owned_processes(owner: str) -> list[int]:
    return processes_with_env(OWNER_ENV, owner)


def describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmdline = "?"
    return f"pid {pid}: {cmdline[:200]}"


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_processes(find, grace_s: float = 5.0) -> list[int]:
    """SIGTERM what `find()` lists (SIGCONT first: a stopped process cannot act on it), wait up
    to `grace_s` for them to go, SIGKILL the rest; returns the pids that had to be killed."""
    pids = find()
    if not pids:
        return []
    _signal_all(pids, signal.SIGCONT)
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and find():
        time.sleep(0.1)
    killed = find()
    _signal_all(killed, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and find():
        time.sleep(0.05)
    return killed


def _kib(path: str, field: bytes) -> int:
    with open(path, "rb") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


@dataclass
class MemoryPeak:
    rss_bytes: int = 0          # resident set sizes added up (shared pages counted once per process)
    pss_bytes: int = 0          # proportional set sizes added up: what the processes cost together
    num_processes: int = 0
    test: str = "(collection)"  # the test that was running when the peak was taken


class MemorySampler:
    """Samples pytest's and every suite process's memory once a second in a daemon thread."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.current_test = "(collection)"
        self.peak = MemoryPeak()
        self.peak_by_test: dict[str, int] = {}  # the largest PSS sum sampled while each test ran
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="suite-memory-sampler", daemon=True)

    def start(self) -> MemorySampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sample()

    def sample(self) -> None:
        rss = pss = count = 0
        for pid in [os.getpid(), *suite_processes()]:
            try:
                pss += _kib(f"/proc/{pid}/smaps_rollup", b"Pss:") << 10
                rss += _kib(f"/proc/{pid}/status", b"VmRSS:") << 10
                count += 1
            except (OSError, ValueError):
                continue
        test = self.current_test
        self.peak_by_test[test] = max(self.peak_by_test.get(test, 0), pss)
        if pss > self.peak.pss_bytes:
            self.peak = MemoryPeak(rss, pss, count, test)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()
