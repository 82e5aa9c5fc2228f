"""The vLLM peer's plumbing (subprocess, token-id hand-over, thread binding, report lines),
against a stand-in `vllm` module: the real one lives in its own venv (`make peer-vllm`) and is
never part of `make test`."""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path

import pytest

from services.entrypoints.bench.vllm_peer import VllmPeer, cpu_bind_list, peer_env
from services.entrypoints.bench.workload import BenchRequest, SamplingKnobs
from services.entrypoints.cli import main

# A stand-in with vLLM's offline API: generate returns `max_tokens` ids per request and records
# what it was given, so the test sees the engine args, sampling and environment that arrived.
# It takes 20 ms per generated token, so a latency run measures a positive inter-token time
# (an instant stand-in left e2e - ttft at the mercy of timer noise, sometimes below zero).
FAKE_VLLM = '''
import json, os, time

__version__ = "fake"
RECORD = os.environ["FAKE_VLLM_RECORD"]


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class _Completion:
    def __init__(self, n):
        self.token_ids = list(range(n))


class _Output:
    def __init__(self, n):
        self.outputs = [_Completion(n)]


class LLM:
    def __init__(self, **engine):
        self.engine = engine
        print("vllm says hello on stdout")  # must not break the protocol

    def generate(self, prompts, params, use_tqdm=True):
        with open(RECORD, "a") as f:
            f.write(json.dumps({"engine": self.engine, "prompts": prompts,
                                "params": [p.__dict__ for p in params],
                                "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                                "kv": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}) + "\\n")
        time.sleep(0.02 * max(p.max_tokens for p in params))
        return [_Output(p.max_tokens) for p in params]
'''


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pkg = tmp_path / "fake" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'fake'} exec {sys.executable} \"$@\"\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("MYVLLM_VLLM_PYTHON", str(python))
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    monkeypatch.setenv("MYVLLM_VLLM_PRELOAD", "0")
    return record


def test_cpu_bind_list() -> None:
    assert cpu_bind_list(2, [0, 1]) == "0,1"
    assert cpu_bind_list(2, [3, 1, 2]) == "1,2"
    with pytest.raises(ValueError):
        cpu_bind_list(3, [0, 1])


def test_peer_env_binds_threads_and_kv_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MYVLLM_VLLM_PRELOAD", "0")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = peer_env(sys.executable, 1, 3 << 29)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(min(os.sched_getaffinity(0)))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["OMP_NUM_THREADS"] == "1"
    assert "PYTHONPATH" not in env and "LD_PRELOAD" not in env


def test_peer_hands_token_ids_over_and_times_generate(fake_vllm: Path) -> None:
    requests = [BenchRequest([101, 102, 103], 4), BenchRequest([200] * 7, 2)]
    peer = VllmPeer("/models/x", "bfloat16", threads=1, seed=5, max_num_seqs=8, max_num_batched_tokens=64)
    try:
        assert peer.version == "fake"
        elapsed = peer.generate(requests, SamplingKnobs(temperature=0.5, top_k=-1))
    finally:
        peer.close()
    assert elapsed >= 0
    (record,) = [json.loads(line) for line in fake_vllm.read_text().splitlines()]
    assert record["engine"]["model"] == "/models/x" and record["engine"]["dtype"] == "bfloat16"
    assert record["engine"]["max_num_seqs"] == 8 and record["engine"]["max_num_batched_tokens"] == 64
    assert [p["prompt_token_ids"] for p in record["prompts"]] == [r.prompt_token_ids for r in requests]
    assert [p["max_tokens"] for p in record["params"]] == [4, 2]
    assert all(p["ignore_eos"] and p["temperature"] == 0.5 and p["top_k"] == 0 and p["seed"] == 5
               for p in record["params"])
    assert record["bind"] == cpu_bind_list(1)


def test_bench_throughput_prints_vllm_ratio(fake_vllm: Path, smollm2_dir: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "throughput", "--model", smollm2_dir, "--num-prompts", "3", "--input-len-min", "8",
               "--input-len-max", "12", "--output-len-min", "3", "--output-len-max", "5", "--no-hf",
               "--no-llamacpp", "--vllm", "--dtype", "float32"])
    assert rc == 0
    out = capsys.readouterr().out
    assert re.search(r"^vllm\s+3\s", out, re.MULTILINE)
    assert re.search(r"^ratio my-vllm / vllm \(output tok/s\): [0-9.]+$", out, re.MULTILINE)
    # the warm-up and the measured workload, both in float32
    records = [json.loads(line) for line in fake_vllm.read_text().splitlines()]
    assert len(records) == 2 and all(r["engine"]["dtype"] == "float32" for r in records)


def test_bench_latency_prints_vllm_ratio(fake_vllm: Path, smollm2_dir: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "latency", "--model", smollm2_dir, "--input-len", "8", "--output-len", "3",
               "--num-iters", "1", "--no-hf", "--no-llamacpp", "--vllm", "--dtype", "float32"])
    assert rc == 0
    assert re.search(r"^ratio vllm / my-vllm \(inter-token latency\): [0-9.]+$", capsys.readouterr().out,
                     re.MULTILINE)


def test_bench_vllm_without_venv_fails_clearly(smollm2_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MYVLLM_VLLM_PYTHON", str(tmp_path / "missing"))
    rc = main(["bench", "throughput", "--model", smollm2_dir, "--num-prompts", "2", "--no-hf", "--vllm"])
    assert rc == 2
    assert "make peer-vllm" in capsys.readouterr().err
