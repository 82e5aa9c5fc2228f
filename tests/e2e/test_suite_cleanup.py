"""SIGTERM of pytest halfway through a run leaves none of the run's processes alive: a
nested pytest run (tests/data/sigterm_probe.py) starts a real `serve` mesh and a process
that ignores SIGTERM, and is sent SIGTERM while they run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from support import suite_processes

TESTS = Path(__file__).resolve().parents[1]
MARK = "MYVLLM_SIGTERM_PROBE"


def _marked(value: str) -> list[int]:
    return suite_processes.processes_with_env(MARK, value)


def test_sigterm_of_pytest_stops_every_process_of_its_run() -> None:
    mark = uuid.uuid4().hex
    env = dict(os.environ, **{MARK: mark}, PYTHONPATH=str(TESTS.parent))
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                            str(TESTS / "data" / "sigterm_probe.py")], cwd=TESTS.parent, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = []
    try:
        deadline = time.monotonic() + 240
        for line in run.stdout:
            output.append(line)
            if "READY" in line:
                break
            assert time.monotonic() < deadline, "".join(output)
        assert "READY" in output[-1], "".join(output)
        redis_pid = int(re.search(r"redis=(\d+)", output[-1]).group(1))
        alive_before = len(_marked(mark))
        assert alive_before >= 6  # pytest, serve, worker, scheduler, gateway, the stubborn one
        run.send_signal(signal.SIGTERM)
        rest, _ = run.communicate(timeout=30)
        output.append(rest)
        deadline = time.monotonic() + 30
        while _marked(mark) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _marked(mark) == [], "".join(output)[-3000:]
        assert not suite_processes.alive(redis_pid), "the run's redis-server outlived it"
        assert run.returncode == 128 + signal.SIGTERM
        assert re.search(r"stopped the run.s processes \([1-9]\d* needed SIGKILL\)", "".join(output))
    finally:
        for pid in _marked(mark):
            os.kill(pid, signal.SIGKILL)
