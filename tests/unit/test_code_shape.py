"""Size limits that keep the central code readable: no function over 120 lines in the engine
and the worker (a long one hides features woven into it: give each its own collaborator), and
the scheduler's token-budget loop in a file of at most 450 lines (its feature concerns live in
their hooks: sched_grammar.py, spec_decode.py, sched_kv_transfer.py, sched_pooling.py)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 120
MAX_SCHEDULER_LINES = 450


def _long_functions(root: Path, base: Path = REPO) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(base)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_in_the_engine_or_the_worker_is_over_120_lines() -> None:
    assert _long_functions(REPO / "services" / "engine") + _long_functions(REPO / "services" / "worker") == []


def test_the_walker_measures_functions(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def long() -> None:\n{body}\n")
    assert _long_functions(tmp_path, tmp_path) == ["long.py:1 long (121 lines)"]


def test_the_scheduler_file_stays_small() -> None:
    lines = (REPO / "services" / "engine" / "scheduler.py").read_text().count("\n")
    assert lines <= MAX_SCHEDULER_LINES, f"services/engine/scheduler.py has {lines} lines"
