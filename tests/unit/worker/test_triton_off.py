"""A CPU process never imports Triton (services/worker/cpu/triton_off.py): building and running
the offline LLM on the default model, in a fresh interpreter, leaves `triton` out of
sys.modules, and its exit prints no `nanobind: leaked ...` lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[3])

SCRIPT = """
import sys
import services.worker.server  # the worker service's modules
from services.offline import LLM, SamplingParams
with LLM(sys.argv[1], dtype="float32", seed=0) as llm:
    llm.generate("Hello", SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
print("triton imported:", "triton" in sys.modules)
"""


def test_the_offline_llm_on_cpu_never_imports_triton(smollm2_dir: str) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT)  # (TRITON_INTERPRET=1 too, as the suite sets it on CPU)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, smollm2_dir], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "triton imported: False" in proc.stdout, proc.stdout
    assert "nanobind" not in proc.stderr, proc.stderr[-3000:]
