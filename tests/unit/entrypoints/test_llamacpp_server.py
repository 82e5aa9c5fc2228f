"""The llama.cpp server peer without a llama.cpp build: its command line, its request body, which
GGUF it runs, and a stand-in `llama-server` (a small HTTP server speaking the endpoints the bench
uses) started, driven and stopped the way the real one is."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
from pathlib import Path

import pytest
from support.fake_llama_server import write_fake_llama_server

from services.entrypoints.bench import llamacpp_server
from services.entrypoints.bench.serve_levels import run_level
from services.entrypoints.bench.workload import BenchRequest, SamplingKnobs


@pytest.fixture
def fake_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    write_fake_llama_server(tmp_path)
    monkeypatch.setenv("MYVLLM_LLAMA_BIN_DIR", str(tmp_path))
    return tmp_path


def test_server_command_gives_each_slot_its_context() -> None:
    cmd = llamacpp_server.server_command("/bin/llama-server", "/m/model.gguf", 8123, parallel=16, threads=2,
                                         n_ctx=384, seed=5)
    assert cmd == ["/bin/llama-server", "-m", "/m/model.gguf", "-np", "16", "-t", "2", "-tb", "2",
                   "-c", str(16 * 384), "--port", "8123", "--host", "127.0.0.1", "--seed", "5"]
    with pytest.raises(ValueError):
        llamacpp_server.server_command("/bin/llama-server", "/m/model.gguf", 8123, parallel=0, threads=2, n_ctx=8)


def test_completion_body_asks_for_exactly_the_output_length() -> None:
    body = llamacpp_server.completion_body(BenchRequest([5, 6, 7], 9), SamplingKnobs())
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 9
    assert body["ignore_eos"] is True and body["cache_prompt"] is False and body["stream"] is False
    assert body["temperature"] == 0.0 and body["top_k"] == 0 and body["repeat_penalty"] == 1.0
    sampled = llamacpp_server.completion_body(BenchRequest([1], 2), SamplingKnobs(temperature=0.7, top_k=40))
    assert sampled["temperature"] == 0.7 and sampled["top_k"] == 40


def test_gguf_for_the_default_model_is_the_shipped_q4_1_file(smollm2_dir: str) -> None:
    from services.entrypoints.bench.llamacpp_peer import smollm2_gguf_path

    assert llamacpp_server.gguf_for(smollm2_dir) == smollm2_gguf_path()
    assert llamacpp_server.gguf_for("/somewhere/else.gguf") == "/somewhere/else.gguf"
    assert llamacpp_server.gguf_for("/tmp") is None


def test_binaries_come_from_the_named_folder(fake_bin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert llamacpp_server.bin_dir() == fake_bin
    assert llamacpp_server.binary("llama-server") == str(fake_bin / "llama-server")
    assert llamacpp_server.binary("llama-perplexity") is None
    assert llamacpp_server.available()
    monkeypatch.setenv("MYVLLM_LLAMA_BIN_DIR", str(fake_bin / "missing"))
    assert not llamacpp_server.available()


def test_latency_peer_starts_drives_and_stops_the_server(fake_bin: Path) -> None:
    peer = llamacpp_server.LlamaServerPeer("/m/model.gguf", n_ctx=256, threads=2, seed=3)
    try:
        argv = json.loads((fake_bin / "argv.json").read_text())
        assert argv[argv.index("-np") + 1] == "1" and argv[argv.index("-c") + 1] == "256"
        assert peer.generate([BenchRequest([1, 2, 3], 4), BenchRequest([4], 2)], SamplingKnobs()) > 0
        sent = json.loads((fake_bin / "completion.json").read_text())
        assert sent["prompt"] == [4] and sent["n_predict"] == 2
    finally:
        peer.close()
    assert peer.proc.poll() is not None


def test_serve_levels_stream_through_the_server(fake_bin: Path) -> None:
    from services.entrypoints.launcher import free_port

    proc, base_url, _ = llamacpp_server.start_server("/m/model.gguf", 4, 2, 64, free_port())
    try:
        requests = [BenchRequest([i + 1] * 5, 3 + i) for i in range(6)]
        result = asyncio.run(run_level(base_url, requests, 4, llamacpp_server.SERVE_NAME))
        assert result.name == "llama-server" and result.concurrency == 4
        assert result.output_tokens == sum(r.output_len for r in requests)
        assert len(result.ttft_s) == len(requests)
    finally:
        llamacpp_server.stop_server(proc)
    assert proc.poll() is not None


def test_a_server_that_dies_is_reported_with_its_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\necho 'error: bad model file' >&2\nexit 3\n")
    server.chmod(server.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("MYVLLM_LLAMA_BIN_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="(?s)code 3.*bad model file"):
        llamacpp_server.start_server("/m/model.gguf", 1, 1, 64, 1)


def test_bench_help_names_the_llama_server_peer() -> None:
    import subprocess

    for sub in ("latency", "serve"):
        out = subprocess.run([sys.executable, "-m", "services.entrypoints.cli", "bench", sub, "--help"],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
        assert out.returncode == 0, out.stderr
        assert "--llamacpp-server" in out.stdout
