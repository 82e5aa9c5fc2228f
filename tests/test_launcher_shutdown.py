"""`myvllm serve` shutdown order: the gateway drains first, alone; the engine goes after it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from services.launcher import _drain_gateway
from services.supervisor import ServiceProcess, stop_all

# Records when it got SIGTERM, takes `delay` seconds to finish (a gateway draining), then exits.
CHILD = """
import signal, sys, time
path, delay = sys.argv[1], float(sys.argv[2])
def on_term(*_):
    with open(path, "w") as f:
        f.write(repr(time.time()))
    time.sleep(delay)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


def _child(tmp_path: Path, name: str, delay: float) -> ServiceProcess:
    service = ServiceProcess(name, [sys.executable, "-c", CHILD, str(tmp_path / name), str(delay)])
    service.proc = subprocess.Popen(service.command, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert service.proc.stdout.readline().strip() == "ready"
    return service


def test_the_gateway_drains_before_the_engine_is_stopped(tmp_path: Path) -> None:
    services = [_child(tmp_path, "worker", 0.0), _child(tmp_path, "scheduler", 0.0), _child(tmp_path, "gateway", 1.0)]
    started = time.monotonic()
    _drain_gateway(services, shutdown_timeout_s=5)
    gateway_done = time.time()
    assert services[2].exit_code == 0 and time.monotonic() - started >= 1.0  # it was waited for
    assert not (tmp_path / "scheduler").exists() and not (tmp_path / "worker").exists()  # untouched meanwhile
    stop_all(services)
    for name in ("scheduler", "worker"):
        assert float((tmp_path / name).read_text()) >= float((tmp_path / "gateway").read_text()) + 1.0
        assert float((tmp_path / name).read_text()) >= gateway_done - 0.05


def test_a_second_sigterm_does_not_cut_the_stop_short(tiny_qwen2_dir: str) -> None:
    """`make` or a supervisor may repeat SIGTERM: serve still stops every service (they run in
    sessions of their own, so an aborted stop would leave them running) and exits cleanly."""
    import os
    import signal

    from mesh import Mesh
    from test_scaling import _children

    mesh = Mesh(["--model", tiny_qwen2_dir, "--max-model-len", "256", "--kv-cache-memory", str(16 << 20)])
    services = _children(mesh.proc.pid)
    assert len(services) == 3  # worker, scheduler, gateway
    mesh.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    mesh.proc.send_signal(signal.SIGTERM)
    assert mesh.proc.wait(timeout=60) == 0
    time.sleep(0.5)
    assert not any(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
                   for pid in services), "a service outlived serve"
    assert "Traceback" not in "".join(mesh.output)
