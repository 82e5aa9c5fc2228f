"""Stopping `myvllm serve` and the service commands: the gateway drains first, alone, and the
engine goes after it; Ctrl-C and SIGTERM stop every command whatever signal dispositions it
inherited (a background job of a non-interactive shell starts with SIGINT ignored); a serve
killed outright takes its services with it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.entrypoints.launcher import _drain_gateway
from services.entrypoints.supervisor import ServiceProcess, stop_all

REPO = Path(__file__).resolve().parents[2]

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

    from support.mesh import Mesh
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
    mesh.stop()
    assert mesh.leftovers == []


def _tiny_mesh(model_dir: str, env: dict[str, str] | None = None):
    from support.mesh import Mesh

    return Mesh(["--model", model_dir, "--max-model-len", "256", "--kv-cache-memory", str(16 << 20)], env=env)


def _wait_for_output(mesh, pattern: str, timeout_s: float = 30) -> str:
    import re

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(pattern, "".join(mesh.output), re.MULTILINE)
        if found:
            return found.group(0)
        time.sleep(0.1)
    raise AssertionError(f"no line matching {pattern!r} in serve's output:\n{''.join(mesh.output)[-3000:]}")


def test_ctrl_c_stops_serve_started_with_sigint_ignored(tiny_qwen2_dir: str) -> None:
    """Mesh starts serve with SIGINT ignored, as `cmd &` in a script does: Ctrl-C still stops
    serve and every service, exit 0, nothing left running. On the way, serve logs as vLLM does:
    an access log line per request, the periodic engine stats line (every second here), and a
    clean stop prints no traceback and no Triton exit noise."""
    import httpx

    mesh = _tiny_mesh(tiny_qwen2_dir, env={"MYVLLM_LOG_STATS_INTERVAL": "1"})
    with open(f"/proc/{mesh.proc.pid}/status") as status:  # serve replaced the inherited SIG_IGN
        ignored = int(next(line for line in status if line.startswith("SigIgn:")).split()[1], 16)
    assert not ignored & (1 << (signal.SIGINT - 1))
    response = httpx.post(f"{mesh.base_url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
    assert response.status_code == 200
    _wait_for_output(mesh, r'^INFO: +127\.0\.0\.1:\d+ - "POST /v1/completions HTTP/1\.1" 200')
    stats = _wait_for_output(mesh, r"^INFO \d\d-\d\d \d\d:\d\d:\d\d \[stats_log\.py:\d+\] Engine 000: Avg prompt "
                             r"throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, Running: \d+ "
                             r"reqs, Waiting: \d+ reqs, GPU KV cache usage: [\d.]+%, Prefix cache hit rate: [\d.]+%$")
    assert "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s" not in stats  # the request's
    assert mesh.stop() == 0
    assert mesh.leftovers == []
    output = "".join(mesh.output)
    assert "stopping..." in output
    for noise in ("Traceback", "nanobind", "CancelledError"):
        assert noise not in output, f"{noise} in serve's output:\n{output[-5000:]}"


def test_a_killed_serve_takes_its_services_with_it(tiny_qwen2_dir: str) -> None:
    """kill -9 of serve alone (its services run in sessions of their own): each service is told
    by the kernel (PR_SET_PDEATHSIG) and stops; none is left as an orphan."""
    from support import suite_processes

    mesh = _tiny_mesh(tiny_qwen2_dir)
    services = [pid for pid in suite_processes.owned_processes(mesh.owner) if pid != mesh.proc.pid]
    assert len(services) == 3
    mesh.proc.kill()
    mesh.proc.wait()
    deadline = time.monotonic() + 20
    while suite_processes.owned_processes(mesh.owner) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [suite_processes.describe(pid) for pid in suite_processes.owned_processes(mesh.owner)]
    mesh.kill()
    assert left == []


def _start_ignoring_sigint(args: list[str]) -> subprocess.Popen:
    from support import suite_processes

    env = dict(suite_processes.owner_env()[1], PYTHONPATH=str(REPO), MYVLLM_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "services.entrypoints.cli", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))


def _stopped_by(proc: subprocess.Popen, sig: int, up) -> tuple[int, str]:
    """Wait until `up()`, send `sig`: (exit code, output)."""
    deadline = time.monotonic() + 120
    try:
        while not up():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "never came up"
            time.sleep(0.2)
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=30)
        return proc.returncode, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_service_commands_stop_on_ctrl_c_and_sigterm_with_sigint_ignored(tiny_qwen2_dir: str, sig: int) -> None:
    from support.processes import free_port

    from services.entrypoints.launcher import _grpc_healthy, _http_healthy

    port = free_port()
    worker = _start_ignoring_sigint(["worker", "--port", str(port), "--model", tiny_qwen2_dir,
                                     "--max-model-len", "256", "--dtype", "float32"])
    code, output = _stopped_by(worker, sig, lambda: _grpc_healthy(f"127.0.0.1:{port}", "worker"))
    assert code == 0 and "Traceback" not in output, output
    port = free_port()
    gateway = _start_ignoring_sigint(["gateway", "--host", "127.0.0.1", "--port", str(port),
                                      "--scheduler", f"127.0.0.1:{free_port()}", "--model", tiny_qwen2_dir])
    # (/metrics: it answers without a scheduler; /v1 waits for one)
    code, output = _stopped_by(gateway, sig, lambda: _http_healthy(f"http://127.0.0.1:{port}/metrics"))
    assert code == 0 and "Traceback" not in output, output
