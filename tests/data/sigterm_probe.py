"""Run by tests/e2e/test_suite_cleanup.py as a pytest run of its own (not collected by the suite: its
name does not start with test_): first does what in-process tests of the suite do to signal
handlers, then starts real processes the way the suite's tests do, says READY, and waits to be
sent SIGTERM halfway through."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import pytest
from support.mesh import Mesh
from support.processes import free_port, start_redis

from services.entrypoints import cli


def test_commands_run_in_process_first() -> None:
    """As test_bench does: `main()` in pytest's own process (it must keep pytest's handlers),
    then an asyncio loop with a SIGTERM handler, which resets SIGTERM to the default when it
    closes (the suite's autouse fixture puts pytest's handler back after this test)."""
    suite_handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert signal.getsignal(signal.SIGTERM) is suite_handler
    loop = asyncio.new_event_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: None)
    loop.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_hold_processes_until_sigterm(smollm2_dir: str) -> None:
    mesh = Mesh(["--model", smollm2_dir, "--max-model-len", "256", "--kv-cache-memory", str(16 << 20)])
    # A process in a session of its own that ignores SIGTERM: only SIGKILL ends it.
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ignoring', flush=True); "
                                 "time.sleep(3600)"], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert stubborn.stdout.readline().strip() == "ignoring"  # SIGTERM can no longer end it
    redis = start_redis(free_port())  # its environment reads empty: the suite tracks it by pid
    print(f"READY serve={mesh.proc.pid} stubborn={stubborn.pid} redis={redis.pid}", flush=True)
    time.sleep(600)
