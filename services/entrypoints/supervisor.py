"""Keeps `myvllm serve`'s service processes running: one that exits is started again, after
a delay that doubles with each quick failure (so a service that cannot start does not spin),
with a log line naming the service and its exit code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

INITIAL_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
# A process that stayed up this long counts as healthy again: its next failure restarts quickly.
STABLE_AFTER_S = 60.0


def log(message: str) -> None:
    print(f"myvllm serve: {message}", file=sys.stderr, flush=True)


class _Restarting:
    """What is restarted when it exits, after a backoff that doubles with each quick failure:
    `start` starts it, `_failure` says why it must restart (None: it runs), `_stop_for_restart`
    stops what is left of it."""

    def __init__(self) -> None:
        self.started_at = 0.0
        self.backoff_s = INITIAL_BACKOFF_S
        self.restart_at: float | None = None
        self.restarts = 0

    def start(self) -> None:
        raise NotImplementedError

    def _failure(self) -> str | None:
        raise NotImplementedError

    def _stop_for_restart(self) -> None:
        """Nothing by default: what exited is gone."""

    def supervise(self) -> None:
        """Call periodically: notices an exit, and restarts once the backoff has passed."""
        now = time.monotonic()
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.restart_at = None
                self.restarts += 1
                self.start()
            return
        failure = self._failure()
        if failure is None:
            if now - self.started_at > STABLE_AFTER_S:
                self.backoff_s = INITIAL_BACKOFF_S
            return
        log(f"{failure} in {self.backoff_s:g}s")
        self._stop_for_restart()
        self.restart_at = time.monotonic() + self.backoff_s
        self.backoff_s = min(self.backoff_s * 2, MAX_BACKOFF_S)


class ServiceProcess(_Restarting):
    """One service's command and its current process."""

    def __init__(self, name: str, command: list[str], env: dict[str, str] | None = None,
                 stdin_data: bytes | None = None) -> None:
        super().__init__()
        self.name = name
        self.command = command
        self.env = env
        self.stdin_data = stdin_data  # written to its stdin at every start (e.g. a secret config)
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        # Its own session: Ctrl-C in the terminal reaches serve only, which stops the
        # services in order; and a signal to one service never hits the others.
        # Through services.entrypoints.die_with_parent: SIGTERM when serve dies, even by SIGKILL.
        command = [sys.executable, "-m", "services.entrypoints.die_with_parent", str(os.getpid()), *self.command]
        self.proc = subprocess.Popen(command, start_new_session=True, env=self.env,
                                     stdin=subprocess.PIPE if self.stdin_data is not None else None)
        if self.stdin_data is not None:
            try:
                self.proc.stdin.write(self.stdin_data)
                self.proc.stdin.close()
            except BrokenPipeError:  # it exited at once: supervise() reports and restarts it
                pass
        self.started_at = time.monotonic()
        log(f"started {self.name} (pid {self.proc.pid})")

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def _failure(self) -> str | None:
        code = self.exit_code
        return None if code is None else f"{self.name} (pid {self.proc.pid}) exited with code {code}; restarting"

    def stop(self) -> None:
        """SIGTERM the service's process group (it may have children)."""
        if self.exit_code is None and self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGTERM)

    def wait_or_kill(self, deadline: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def stop_all(services: list[ServiceProcess], grace_s: float = 10.0) -> None:
    """Stop in reverse start order (the gateway first), then wait; SIGKILL stragglers."""
    for service in reversed(services):
        service.stop()
    deadline = time.monotonic() + grace_s
    for service in services:
        service.wait_or_kill(deadline)


class ServiceGroup(_Restarting):
    """Services that live and die together: a data-parallel expert-parallel group's workers and
    schedulers, whose ranks share one process group (one that exits leaves the others blocked in
    a collective it will never join). One exits: every member is stopped, and after the backoff
    all start again, in order."""

    def __init__(self, name: str, members: list[ServiceProcess]) -> None:
        super().__init__()
        self.name = name
        self.members = members
        self.started_at = time.monotonic()

    def start(self) -> None:
        self.started_at = time.monotonic()
        for member in self.members:
            member.start()

    def _failure(self) -> str | None:
        first = next((m for m in self.members if m.exit_code is not None), None)
        if first is None:
            return None
        return (f"{first.name} (pid {first.proc.pid}) exited with code {first.exit_code}; stopping the {self.name} "
                f"({len(self.members)} services) and restarting it")

    def _stop_for_restart(self) -> None:
        for member in self.members:
            member.stop()
        deadline = time.monotonic() + 10.0
        for member in self.members:
            member.wait_or_kill(deadline)
