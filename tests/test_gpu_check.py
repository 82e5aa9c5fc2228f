"""`make gpu-check`'s stages that have a CPU path, smoke-run here so the script a GPU session
carries does not fail on its own code: the sampler stage, the throughput stage in both modes (the
static buffers standing in for graphs) on a tiny shape, and the report that merges their figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _stage(results: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, GPU_CHECK_RESULTS=str(results), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "scripts/gpu_check.py", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_cpu_paths_of_the_gpu_check_stages_and_their_report(tmp_path: Path) -> None:
    results, out = tmp_path / "results", tmp_path / "out"
    sampling = _stage(results, "sampling", "--device", "cpu")
    assert sampling.returncode == 0, sampling.stdout + sampling.stderr
    throughput = _stage(results, "throughput", "--device", "cpu", "--tiny", "--num-requests", "12", "--min-len", "8",
                        "--max-len", "24", "--dtype", "float32", "--max-num-seqs", "8", "--kv-cache-gib", "1")
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
