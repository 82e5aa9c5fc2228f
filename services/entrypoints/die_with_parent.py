"""`python -m services.entrypoints.die_with_parent PARENT_PID COMMAND [ARG...]`: run COMMAND so that the
kernel sends it SIGTERM when process PARENT_PID dies, even by SIGKILL (PR_SET_PDEATHSIG, which
survives exec). `serve` starts every service through it: the services run in sessions of their
own, so nothing else would reach them.

Why not a `preexec_fn` in the parent: that forces a plain fork() of `serve`, whose gRPC health
checks leave grpc threads and fork handlers behind; a fork while they run can deadlock inside
grpc's pre-fork handler (seen: `serve` stuck in fork() for 20 minutes under load). Without a
preexec_fn, subprocess starts the child with vfork/posix_spawn, which runs no fork handlers.

Imports nothing of the project: it runs before every service, and must be quick.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python -m services.entrypoints.die_with_parent PARENT_PID COMMAND [ARG...]", file=sys.stderr)
        return 2
    parent_pid, command = int(argv[0]), argv[1:]
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl (not Linux): a killed serve leaves its services
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect: do not start at all
        return 1
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"cannot run {command[0]}: {e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
