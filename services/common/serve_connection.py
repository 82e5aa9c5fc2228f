"""Where a running `myvllm serve` tells SDK clients on the same machine how to reach it: a file
per serve (by HTTP port) in this user's runtime directory, readable by this user alone, holding
the schedulers' addresses and the run's internal token. `Client()` with no address reads it, so
the gRPC SDK works against `make up` without copying a token around."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


def runtime_dir() -> Path:
    """$XDG_RUNTIME_DIR/myvllm, else a per-user directory in the temp dir (0700 either way)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base) / "myvllm" if base else Path(tempfile.gettempdir()) / f"myvllm-{os.getuid()}"


def connection_path(http_port: int) -> Path:
    return runtime_dir() / f"serve-{http_port}.json"


@dataclass
class ServeConnection:
    schedulers: list[str]  # host:port of each engine replica's scheduler
    token: str             # the run's internal token
    http_port: int
    pid: int               # the serve process (a file whose process is gone is stale)

    def write(self) -> Path:
        """Write it where clients look, readable by this user alone."""
        path = connection_path(self.http_port)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.parent.stat().st_uid != os.getuid() or path.parent.stat().st_mode & 0o077:
            raise PermissionError(f"{path.parent} is not this user's private directory: refusing to write the "
                                  "internal token there")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"schedulers": self.schedulers, "token": self.token, "http_port": self.http_port,
                       "pid": self.pid}, f)
        return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def find_serve(http_port: int | None = None) -> ServeConnection:
    """The running serve on `http_port`, or the only one running; FileNotFoundError saying what
    to do otherwise."""
    directory = runtime_dir()
    paths = [connection_path(http_port)] if http_port is not None else sorted(directory.glob("serve-*.json"))
    found = []
    for path in paths:
        try:
            if path.stat().st_uid != os.getuid():
                continue  # (only this user's own files are trusted)
            data = json.loads(path.read_text())
            connection = ServeConnection(list(data["schedulers"]), str(data["token"]), int(data["http_port"]),
                                         int(data["pid"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _alive(connection.pid):
            found.append(connection)
    if len(found) == 1:
        return found[0]
    where = f"on port {http_port}" if http_port is not None else "on this machine"
    if not found:
        raise FileNotFoundError(f"no running `myvllm serve` {where} (looked in {directory}); start one, or give the "
                                "scheduler's address and token")
    raise FileNotFoundError(f"{len(found)} `myvllm serve` processes run (HTTP ports "
                            f"{', '.join(str(c.http_port) for c in found)}): name one with http_port=")
