"""`make gpu-check`'s stages that have a CPU path, smoke-run here so the script a GPU session
carries does not fail on its own code: the sampler stage, the throughput stage in both modes (the
static buffers standing in for graphs) on a tiny shape, and the report that merges their figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _start(results: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, GPU_CHECK_RESULTS=str(results), PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "scripts/gpu_check.py", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _stage(results: Path, *args: str) -> subprocess.CompletedProcess:
    return _finish(_start(results, *args))


def test_cpu_paths_of_the_gpu_check_stages_and_their_report(tmp_path: Path) -> None:
    results, out = tmp_path / "results", tmp_path / "out"
    # The two stages are independent (each writes its own figures): run side by side, their
    # start-ups (imports, a model load) overlap.
    sampling = _start(results, "sampling", "--device", "cpu")
    throughput = _start(results, "throughput", "--device", "cpu", "--tiny", "--num-requests", "12", "--min-len", "8",
                        "--max-len", "24", "--dtype", "float32", "--max-num-seqs", "8", "--kv-cache-gib", "1")
    sampling, throughput = _finish(sampling), _finish(throughput)
    assert sampling.returncode == 0, sampling.stdout + sampling.stderr
    assert throughput.returncode == 0, throughput.stdout + throughput.stderr
    figures = json.loads((results / "throughput.json").read_text())
    assert figures["eager_mode"] == "none" and figures["graphs_mode"] == "static"
    assert figures["eager_output_tok_s"] > 0 and figures["graphs_output_tok_s"] > 0
    (results / "verdicts.tsv").write_text("sampling\tPASS\t3\nthroughput\tPASS\t20\n")
    report = _stage(results, "report", "--verdicts", str(results / "verdicts.tsv"), "--out", str(out))
    assert report.returncode == 0, report.stderr
    merged = json.loads((out / "gpu_check.json").read_text())
    assert [s["stage"] for s in merged["stages"]] == ["sampling", "throughput"]
    assert merged["stages"][0]["figures"]["host_syncs"] is False and merged["total_seconds"] == 23
    table = (out / "gpu_check.md").read_text()
    assert "| sampling | PASS | 3 |" in table and "graphs_over_eager" in table
