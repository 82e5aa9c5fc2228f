"""`make gpu-check` fits its device time: the stage limits in scripts/gpu_check.sh add up to at
most 6 minutes, every stage it runs is one scripts/gpu_check.py knows, and the script parses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = 360


def _stages() -> list[tuple[str, int, str]]:
    text = (REPO / "scripts" / "gpu_check.sh").read_text()
    return [(m[1], int(m[2]), m[3]) for m in re.finditer(r"^run_stage (\S+) (\d+) (\S+)", text, re.M)]


def test_the_stage_limits_add_up_to_six_minutes_at_most() -> None:
    text = (REPO / "scripts" / "gpu_check.sh").read_text()
    probe = [int(n) for n in re.findall(r'^timeout (\d+) "\$PY" scripts/gpu_check.py probe', text, re.M)]
    stages = _stages()
    assert len(probe) == 1 and len(stages) >= 10
    assert probe[0] + sum(limit for _, limit, _ in stages) <= BUDGET_S


def test_every_stage_is_one_gpu_check_py_runs() -> None:
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for _, _, stage in _stages():
        assert stage in proc.stdout
    for name in ("bf16", "moe_graphs", "spec_graphs", "pd"):
        assert name in proc.stdout
    assert subprocess.run(["bash", "-n", "scripts/gpu_check.sh"], cwd=REPO).returncode == 0


def test_near_ties_are_tolerated_and_real_mismatches_are_not() -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_check_stages as stages
    finally:
        sys.path.remove(str(REPO / "scripts"))
    want = [[1, 2, 3], [4, 5, 6]]
    assert stages.compare_with_ties("t", want, want, [[9, 9, 9], [9, 9, 9]])
    assert stages.compare_with_ties("t", [[1, 7, 8], [4, 5, 6]], want, [[9, 1e-4, 9], [9, 9, 9]])  # a near tie
    assert not stages.compare_with_ties("t", [[1, 7, 8], [4, 5, 6]], want, [[9, 0.5, 9], [9, 9, 9]])
    assert not stages.compare_with_ties("t", [[1, 2], [4, 5, 6]], want, [[9, 9, 9], [9, 9, 9]])  # shorter
