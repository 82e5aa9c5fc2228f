"""Where a Triton kernel test runs its kernels, shared by the Triton test files: on CUDA compiled,
else under TRITON_INTERPRET=1 on CPU tensors. Import it before anything that imports triton: it
sets TRITON_INTERPRET on a machine without CUDA (triton decides at import time; `import torch`
does not import it).

When another test module imported triton first, triton's own helpers were built for a GPU and
cannot be interpreted in this process (STALE_TRITON): the kernels then run in a fresh pytest
process of the same file (`run_in_fresh_interpreter`), and `needs_device` skips them here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from services.worker.attention import triton_kernels  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
INTERPRETED = triton_kernels.is_interpreted()
STALE_TRITON = os.environ.get("TRITON_INTERPRET") == "1" and not (
    INTERPRETED and triton_kernels.interpreter_consistent())
DEVICE = None if STALE_TRITON else "cpu" if INTERPRETED else "cuda" if torch.cuda.is_available() else None
needs_device = pytest.mark.skipif(DEVICE is None, reason="triton was imported before TRITON_INTERPRET was set "
                                  "(the fresh-process test runs this file) or there is no CUDA")
fresh_process_only = pytest.mark.skipif(not STALE_TRITON, reason="the kernels run in this process")


def run_in_fresh_interpreter(test_file: str, timeout_s: float = 900) -> None:
    """Run `test_file` in a new pytest process under TRITON_INTERPRET=1; its tests must pass."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]
