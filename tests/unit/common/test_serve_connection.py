"""How `Client()` finds the `myvllm serve` running on this machine: the file serve writes for
its user alone, stale files (their serve gone) ignored, an ambiguous choice refused."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from services.client.grpc_client import Client
from services.common import serve_connection
from services.common.serve_connection import ServeConnection, find_serve


@pytest.fixture(autouse=True)
def runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def test_the_file_is_private_and_found() -> None:
    path = ServeConnection(["127.0.0.1:5001"], "secret-token-0123456789", 8000, os.getpid()).write()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    found = find_serve()
    assert (found.schedulers, found.token) == (["127.0.0.1:5001"], "secret-token-0123456789")
    assert find_serve(8000).http_port == 8000


def test_a_file_whose_serve_is_gone_is_ignored() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    ServeConnection(["127.0.0.1:5001"], "t" * 20, 8000, int(dead.stdout)).write()
    with pytest.raises(FileNotFoundError, match="no running `myvllm serve` on this machine"):
        find_serve()


def test_two_serves_must_be_named_by_port() -> None:
    for port in (8000, 8001):
        ServeConnection([f"127.0.0.1:{port + 100}"], "t" * 20, port, os.getpid()).write()
    with pytest.raises(FileNotFoundError, match="2 `myvllm serve` processes run .*8000, 8001.*http_port="):
        find_serve()
    assert find_serve(8001).schedulers == ["127.0.0.1:8101"]


def test_a_directory_others_can_read_is_refused(runtime_dir) -> None:
    (runtime_dir / "myvllm").mkdir(mode=0o755)
    os.chmod(runtime_dir / "myvllm", 0o755)
    with pytest.raises(PermissionError, match="not this user's private directory"):
        ServeConnection(["127.0.0.1:5001"], "t" * 20, 8000, os.getpid()).write()


def test_the_client_without_an_address_says_what_to_do() -> None:
    with pytest.raises(FileNotFoundError, match="start one, or give the scheduler's address and token"):
        Client()
    assert serve_connection.runtime_dir().name == "myvllm"
