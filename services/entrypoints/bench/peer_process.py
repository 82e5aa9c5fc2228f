"""Waiting for a peer server the bench started (vLLM's, llama.cpp's) to answer."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx


def wait_until_ready(proc: subprocess.Popen, url: str, log_path: Path, name: str, timeout_s: float,
                     poll_s: float = 0.5) -> None:
    """Return once GET `url` answers 200; RuntimeError with the end of the server's log if it
    exits first, or naming the log if it does not answer within `timeout_s` (the caller stops it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited (code {proc.returncode}); end of its log:\n"
                               f"{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"{name} did not answer {url} within {timeout_s:.0f} s; see {log_path}")
