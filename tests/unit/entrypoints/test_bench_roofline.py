"""`myvllm bench roofline`: the floor / efficiency / GEMM-peak arithmetic on fake measurements,
and one tiny real run (--quick) whose table and JSON hold every figure, positive."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.entrypoints.bench.roofline import (
    EngineFigures,
    MachineLimits,
    ModelShape,
    decode_step_flops,
    engine_efficiency,
    report,
    to_json,
)
from services.entrypoints.bench.roofline_measure import gemm_peak_flops_s, model_shape
from services.entrypoints.cli import main

LIMITS = MachineLimits(bandwidth_bytes_s={1: 10e9, 2: 20e9},
                       gemm_flops_s={"float32": {1: 100e9, 2: 200e9}, "bfloat16": {1: 400e9, 2: 800e9}})


def test_decode_step_flops_counts_projections_and_attention() -> None:
    shape = ModelShape(params=1_000_000, layers=2, heads=4, head_dim=8)
    # 2 FLOPs per parameter per request, plus 4 x layers x heads x head_dim per context token per request.
    assert decode_step_flops(shape, 3, 10) == 2 * 1_000_000 * 3 + 4 * 2 * 4 * 8 * 10 * 3
    assert decode_step_flops(shape, 1, 0) == 2_000_000


def test_floor_efficiency_and_fraction_of_peak() -> None:
    figures = EngineFigures(dtype="bfloat16", threads=2, weight_bytes=200_000_000, itl_s=0.02, batch=64,
                            step_s=0.05, step_flops=20e9)
    e = engine_efficiency(figures, LIMITS)
    assert e.floor_s == pytest.approx(0.01)
    assert e.efficiency == pytest.approx(0.5)  # floor / ITL
    assert e.step_flops_s == pytest.approx(400e9)
    assert e.fraction_of_gemm_peak == pytest.approx(0.5)
    d = e.to_dict()
    assert d["dtype"] == "bfloat16" and d["efficiency"] == pytest.approx(0.5)


def test_missing_measurements_leave_their_figures_out() -> None:
    skipped = EngineFigures(dtype="float32", threads=4, weight_bytes=100)  # no ITL, no step; 4 threads unmeasured
    e = engine_efficiency(skipped, LIMITS)
    assert (e.floor_s, e.efficiency, e.step_flops_s, e.fraction_of_gemm_peak) == (None, None, None, None)
    text = report(MachineLimits({}, {}), [e], ["float32", "bfloat16"])
    assert "batch-1 ITL ms" in text and "n/a" in text and "GEMM peak" not in text


def test_report_has_a_row_per_figure_and_a_column_per_dtype() -> None:
    engine = [engine_efficiency(EngineFigures("float32", 2, 400_000_000, 0.05, 64, 0.1, 20e9), LIMITS),
              engine_efficiency(EngineFigures("bfloat16", 2, 200_000_000, 0.02, 64, 0.05, 20e9), LIMITS)]
    text = report(LIMITS, engine, ["float32", "bfloat16"])
    lines = text.splitlines()
    assert lines[0].split() == ["figure", "threads", "float32", "bfloat16"]
    assert any(line.startswith("read bandwidth GB/s") and line.split()[-3:] == ["2", "20.0", "20.0"]
               for line in lines)
    assert any(line.startswith("GEMM peak GFLOP/s") and line.split()[-3:] == ["1", "100.0", "400.0"]
               for line in lines)
    assert any(line.startswith("batch-1 efficiency") and line.split()[-2:] == ["0.40", "0.50"] for line in lines)
    assert any(line.startswith("64-request % of GEMM peak") and line.split()[-2:] == ["100.0", "50.0"]
               for line in lines)
    data = to_json(LIMITS, engine)
    assert data["read_bandwidth_bytes_s"] == {"1": 10e9, "2": 20e9}
    assert [e["dtype"] for e in data["engine"]] == ["float32", "bfloat16"]


def test_model_shape_and_gemm_peak(smollm2_dir: str) -> None:
    shape = model_shape(smollm2_dir)
    assert (shape.layers, shape.heads, shape.head_dim) == (30, 9, 64)
    assert 130e6 < shape.params < 140e6  # SmolLM2-135M, its tied embedding counted once as the LM head
    assert gemm_peak_flops_s("float32", 1, [(64, 64, 64)], repeats=1) > 0


def _table(out: str) -> dict[tuple[str, int], list[str]]:
    """The table's rows by (figure, threads): the cells after them."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["figure", "threads"])
    rows = {}
    for line in lines[start + 1:]:
        cells = line.split()
        for i, cell in enumerate(cells):
            if cell.isdigit() and i > 0:
                rows[(" ".join(cells[:i]), int(cell))] = cells[i + 1:]
                break
    return rows


def test_bench_roofline_quick(smollm2_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    json_path = tmp_path / "roofline.json"
    rc = main(["bench", "roofline", "--model", smollm2_dir, "--quick", "--dtype", "float32", "--batch-size", "4",
               "--json", str(json_path)])
    assert rc == 0
    rows = _table(capsys.readouterr().out)
    figures = {figure for figure, _ in rows}
    assert {"read bandwidth GB/s", "GEMM peak GFLOP/s", "weights MB per token", "batch-1 ITL ms",
            "batch-1 floor ms (weights / bandwidth)", "batch-1 efficiency (floor / ITL)",
            "4-request decode step ms", "4-request GFLOP/s", "4-request % of GEMM peak"} <= figures
    assert {t for figure, t in rows if figure == "read bandwidth GB/s"} >= {1}
    for key, cells in rows.items():
        assert len(cells) == 1 and float(cells[0]) > 0, key
    data = json.loads(json_path.read_text())
    assert data["benchmark"] == "roofline" and all(v > 0 for v in data["read_bandwidth_bytes_s"].values())
    [engine] = data["engine"]
    for field in ("itl_s", "floor_s", "efficiency", "step_s", "step_flops", "step_flops_s", "fraction_of_gemm_peak"):
        assert engine[field] > 0, field


def test_bench_roofline_refuses_a_gguf_engine_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "roofline", "--model", "model.Q4_1.gguf", "--quick"]) == 2
    assert "checkpoint directory" in capsys.readouterr().err
