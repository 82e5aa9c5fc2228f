"""Run by tests/test_suite_cleanup.py as a pytest run of its own (not collected by the suite: its
name does not start with test_): starts real processes the way the suite's tests do, says
READY, and waits to be sent SIGTERM halfway through."""

from __future__ import annotations

import subprocess
import sys
import time

from mesh import Mesh


def test_hold_processes_until_sigterm(smollm2_dir: str) -> None:
    mesh = Mesh(["--model", smollm2_dir, "--max-model-len", "256", "--kv-cache-memory", str(16 << 20)])
    # A process in a session of its own that ignores SIGTERM: only SIGKILL ends it.
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ignoring', flush=True); "
                                 "time.sleep(3600)"], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert stubborn.stdout.readline().strip() == "ignoring"  # SIGTERM can no longer end it
    print(f"READY serve={mesh.proc.pid} stubborn={stubborn.pid}", flush=True)
    time.sleep(600)
