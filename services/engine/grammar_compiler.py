"""Grammar compilation with a time limit, in a process of its own that can be killed.

xgrammar has no way to stop a compile once it started, and some constraints take far longer
than any real one: a regex with nested bounded repetition, `([a-z0-9 ]{1,200},){1,200}`,
compiles for seconds of one core, and the cost grows with the bounds (figures in
tests/e2e/test_grammar_compile_timeout.py). The compile does release the GIL (measured: the
scheduler's event loop keeps running beside it), so a thread would not freeze the scheduler;
but a thread cannot be interrupted: one past its limit would keep a core busy until xgrammar
finishes on its own, and a few such schemas would hold every thread of a bounded pool.

So the scheduler starts one helper process, at its first constrained request:
`python -m services.engine.grammar_compiler`. It imports xgrammar once (seconds), builds
the tokenizer's `TokenizerInfo` from the JSON the scheduler sends, lowers its priority to
nice 19 (a compile takes the CPU the engine leaves: it does not slow the steps of the
requests that run, which on a 2-core machine it otherwise would) and forks one short-lived
child per compile job. The child parses and compiles the constraint and writes the compiled
grammar back (xgrammar's own JSON serialization; the scheduler deserializes it, also with the
GIL released). The helper watches each child's CPU time and SIGKILLs one that passes the
limit: the job ends as timed out and nothing of it is left running. The limit counts CPU
time, not wall-clock time, because at nice 19 on a busy machine a compile may wait for a core
and a schema must not fail for the machine's load; a compile is also stopped after
STRUCTURED_OUTPUTS_COMPILE_WALL_FACTOR times the limit of wall-clock time, so that a starved one cannot hold its
place in the pool forever. A fork is cheap (xgrammar and the vocabulary are already in
memory), so a timeout costs nothing after it, unlike a process that must import xgrammar again.

The scheduler side (`GrammarCompileProcess`) sends at most as many jobs at once as the
threads of the `StructuredOutputManager`'s pool (2), so a flood of constraints queues there.

Frames both ways: a 4-byte big-endian length, then a pickle (both ends are this module).
  scheduler -> helper: ("init", tokenizer_info_json), then ("compile", job_id, spec_bytes, timeout_s)
  helper -> scheduler: ("ready",), then per job one of ("done", job_id, compiled_json, seconds),
      ("invalid", job_id, message, param), ("timeout", job_id, seconds), ("crashed", job_id, how)
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import pickle
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

from services.common.config import STRUCTURED_OUTPUTS_COMPILE_WALL_FACTOR
from services.common.structured_outputs import StructuredOutputsError

logger = logging.getLogger(__name__)

# The helper's niceness (its compile children inherit it).
COMPILE_NICE = 19
# Importing xgrammar (it imports torch and transformers) takes seconds, more on a loaded machine.
STARTUP_TIMEOUT_S = 180.0
# How often the helper reads its running compiles' CPU time (/proc/PID/stat counts in ticks).
CPU_POLL_S = 0.02
# The scheduler gives up on the helper itself (and starts a new one) only if no answer comes
# this long after a job's wall-clock limit.
HELPER_GRACE_S = 30.0
_HEADER = struct.Struct(">I")
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding `services`


class GrammarCompileTimeout(StructuredOutputsError):
    """The constraint did not compile within --structured-outputs-compile-timeout seconds of CPU
    time (a 400: the constraint is what takes too long)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"structured output grammar did not compile within {timeout_s:g} s of CPU time "
                         "(--structured-outputs-compile-timeout)", "structured_outputs")
        self.timeout_s = timeout_s


class CompilerUnavailable(RuntimeError):
    """The helper process could not be started or stopped answering (the engine's fault)."""


def _write_frame(out: BinaryIO | int, message: tuple) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    frame = _HEADER.pack(len(data)) + data
    if isinstance(out, int):
        view = memoryview(frame)
        while view:
            view = view[os.write(out, view):]
    else:
        out.write(frame)
        out.flush()


def _read_exact(stream: BinaryIO, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_frame(stream: BinaryIO) -> tuple | None:
    """One message, or None at the end of the stream."""
    header = _read_exact(stream, _HEADER.size)
    if header is None:
        return None
    data = _read_exact(stream, _HEADER.unpack(header)[0])
    return None if data is None else pickle.loads(data)


def _frames(buffer: bytearray) -> list[tuple]:
    """The complete messages at the front of `buffer` (removed from it)."""
    messages = []
    while len(buffer) >= _HEADER.size:
        size = _HEADER.unpack_from(buffer)[0]
        if len(buffer) < _HEADER.size + size:
            break
        messages.append(pickle.loads(bytes(buffer[_HEADER.size:_HEADER.size + size])))
        del buffer[:_HEADER.size + size]
    return messages


# ---------------------------------------------------------------------- the scheduler's side


class _Job:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.reply: tuple | None = None


class GrammarCompileProcess:
    """The scheduler's handle on the helper: `compile()` blocks its calling thread (one of the
    manager's pool threads) until the helper answers; several threads may call it at once."""

    def __init__(self, tokenizer_info_json, timeout_s: float) -> None:
        """`tokenizer_info_json`: a callable giving `TokenizerInfo.serialize_json()` (called
        at the first start only)."""
        self._tokenizer_info_json = tokenizer_info_json
        self._info_json: str | None = None
        self.timeout_s = float(timeout_s)
        self._lock = threading.Lock()  # the helper's state below; held while it starts
        self._write_lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._jobs: dict[int, _Job] = {}
        self._ready = threading.Event()
        self._ids = itertools.count(1)
        self._closed = False
        # When the running helper became ready (None while it starts): its start-up (importing
        # xgrammar, seconds) is the engine's cost, not counted in any request's grammar budget.
        self.ready_since: float | None = None
        self.num_starts = 0
        self.num_timeouts = 0

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def compile(self, spec_bytes: bytes) -> tuple[str, float]:
        """(the compiled grammar's JSON, compile seconds) for a serialized `StructuredOutputs`.
        Raises StructuredOutputsError (GrammarCompileTimeout past the limit) for the request,
        CompilerUnavailable when the helper cannot do the job."""
        proc = self._ensure_started()
        job_id, job = next(self._ids), _Job()
        with self._lock:
            if self._proc is not proc:
                raise CompilerUnavailable("the grammar compiler process exited")
            jobs = self._jobs
            jobs[job_id] = job
        try:
            with self._write_lock:
                _write_frame(proc.stdin, ("compile", job_id, spec_bytes, self.timeout_s))
        except (OSError, ValueError) as e:  # (ValueError: its stdin was closed)
            with self._lock:
                jobs.pop(job_id, None)
            raise CompilerUnavailable(f"the grammar compiler process exited ({e})") from None
        if not job.done.wait(self.timeout_s * STRUCTURED_OUTPUTS_COMPILE_WALL_FACTOR + HELPER_GRACE_S):
            with self._lock:
                jobs.pop(job_id, None)
            self._kill(proc, f"no answer {HELPER_GRACE_S:g} s past a job's deadline")
            raise CompilerUnavailable("the grammar compiler process stopped answering")
        reply = job.reply
        kind = reply[0]
        if kind == "done":
            return reply[2], reply[3]
        if kind == "invalid":
            raise StructuredOutputsError(reply[2], reply[3])
        if kind == "timeout":
            self.num_timeouts += 1
            raise GrammarCompileTimeout(reply[2])
        if kind == "crashed":
            raise StructuredOutputsError(f"structured output grammar compilation failed: the compiler {reply[2]}")
        raise CompilerUnavailable(reply[2] if len(reply) > 2 else f"the grammar compiler failed ({kind})")

    def _ensure_started(self) -> subprocess.Popen:
        with self._lock:
            if self._closed:
                raise CompilerUnavailable("the grammar compiler is closed")
            if self._proc is not None and self._proc.poll() is None:
                proc = self._proc
            else:
                proc = self._start()
            ready = self._ready
        if not ready.wait(STARTUP_TIMEOUT_S):
            self._kill(proc, f"not ready within {STARTUP_TIMEOUT_S:g} s")
            raise CompilerUnavailable(f"the grammar compiler process did not start within {STARTUP_TIMEOUT_S:g} s")
        if proc.poll() is not None:
            raise CompilerUnavailable(f"the grammar compiler process exited with code {proc.returncode}")
        return proc

    def _start(self) -> subprocess.Popen:
        """Start the helper (the lock is held); the reader thread reports it ready. It imports
        xgrammar while this process builds the tokenizer's info (the first time)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(_PACKAGE_ROOT), *filter(None, [env.get("PYTHONPATH")])])
        # stderr stays the scheduler's: the helper's warnings land in the scheduler's log.
        proc = subprocess.Popen([sys.executable, "-m", "services.engine.grammar_compiler"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, cwd=str(_PACKAGE_ROOT))
        self.num_starts += 1
        self._proc, self._jobs, self._ready = proc, {}, threading.Event()
        self.ready_since = None
        try:
            if self._info_json is None:
                self._info_json = self._tokenizer_info_json()
            _write_frame(proc.stdin, ("init", self._info_json))
        except OSError:
            pass  # it exited at once: the reader reports it
        threading.Thread(target=self._read_replies, args=(proc, self._jobs, self._ready),
                         name="grammar-compiler-reader", daemon=True).start()
        return proc

    def _read_replies(self, proc: subprocess.Popen, jobs: dict[int, _Job], ready: threading.Event) -> None:
        """Hand each reply to its job; when the helper exits, fail the jobs it still had."""
        try:
            while (message := _read_frame(proc.stdout)) is not None:
                if message[0] == "ready":
                    self.ready_since = time.monotonic()
                    ready.set()
                    continue
                with self._lock:
                    job = jobs.pop(message[1], None)
                if job is not None:
                    job.reply = message
                    job.done.set()
        except (OSError, ValueError, pickle.UnpicklingError) as e:
            logger.warning("grammar compiler: unreadable reply (%s); stopping it", e)
        self._kill(proc, None)
        code = proc.wait()
        with self._lock:
            if self._proc is proc:
                self._proc = None
            orphans = list(jobs.values())
            jobs.clear()
        if not self._closed:
            logger.warning("grammar compiler process exited with code %s; the next compile starts a new one", code)
        for job in orphans:
            job.reply = ("lost", 0, f"the grammar compiler process exited with code {code}")
            job.done.set()
        ready.set()  # a thread still waiting for the start sees the exit

    def _kill(self, proc: subprocess.Popen, reason: str | None) -> None:
        if reason is not None:
            logger.warning("grammar compiler process %d: %s; killing it", proc.pid, reason)
        if proc.poll() is None:
            proc.kill()  # its compile children follow it (PR_SET_PDEATHSIG)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            proc = self._proc
        if proc is not None:
            self._kill(proc, None)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass


# ---------------------------------------------------------------------- the helper process


def _lower_priority() -> None:
    """nice COMPILE_NICE for the helper and its compile children. Where the kernel shares CPU
    time out by session first (autogroup, on by default: /proc/sys/kernel/sched_autogroup_enabled),
    a nice value only orders tasks within their own session: the helper, in the scheduler's
    session, would take that whole session's share while the scheduler sleeps, at the worker's
    expense (beside other CPU-bound processes the streams' tail ITL doubled while a compile ran). So
    it also starts a session of its own and gives that group the same low weight. (Its stdin
    still closes when the scheduler dies, which ends it.) And it runs SCHED_IDLE: the kernel
    preempts an idle-policy task at once when any other task wakes, whatever their groups, while
    a nice task keeps the CPU for the rest of its slice (EEVDF): each step's worker threads woke
    behind a running compile and their tail ITL grew by a third or more, where SCHED_IDLE keeps it
    within a few percent of a run without a compile."""
    try:
        os.nice(COMPILE_NICE)
    except OSError:
        pass
    try:  # Linux: SCHED_IDLE, which any waking task of another policy preempts at once
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass
    try:
        os.setsid()
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(COMPILE_NICE))
    except OSError:  # no autogroup (or not Linux): the nice value is all there is
        pass


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when the helper dies (a killed scheduler takes the helper
    with it by closing its stdin; a compile child is killed through this)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the helper died before prctl
        os._exit(1)


def _compile_job(info: Any, spec_bytes: bytes, job_id: int, out_fd: int) -> None:
    """In a forked child: parse and compile, write the one reply, exit."""
    code = 0
    try:
        import xgrammar as xgr

        from services.common.proto import myvllm_pb2 as pb
        from services.common.structured_outputs import build_grammar

        start = time.perf_counter()
        try:
            grammar = build_grammar(pb.StructuredOutputs.FromString(spec_bytes))
            compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_grammar(grammar)
            reply: tuple = ("done", job_id, compiled.serialize_json(), time.perf_counter() - start)
        except StructuredOutputsError as e:
            reply = ("invalid", job_id, str(e), e.param)
        except Exception as e:  # noqa: BLE001 - xgrammar reports what it cannot compile as RuntimeError
            reply = ("invalid", job_id, f"structured output grammar failed to compile: {type(e).__name__}: {e}",
                     "structured_outputs")
        _write_frame(out_fd, reply)
    except BaseException:  # noqa: BLE001 - the helper reports a child that wrote nothing as crashed
        code = 1
    finally:
        os._exit(code)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process (Linux /proc; None where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime: fields 14 and 15 of stat


class _Running:
    """A compile child: its reply pipe, its CPU-time limit and its wall-clock backstop."""

    def __init__(self, job_id: int, pid: int, fd: int, timeout_s: float) -> None:
        self.job_id, self.pid, self.fd, self.timeout_s = job_id, pid, fd, timeout_s
        self.wall_deadline = time.monotonic() + timeout_s * STRUCTURED_OUTPUTS_COMPILE_WALL_FACTOR
        self.buffer = bytearray()

    def over_limit(self, now: float) -> bool:
        if now >= self.wall_deadline:
            return True
        cpu = _cpu_seconds(self.pid)
        if cpu is None:  # no /proc: the limit counts wall-clock time instead
            return now >= self.wall_deadline - self.timeout_s * (STRUCTURED_OUTPUTS_COMPILE_WALL_FACTOR - 1)
        return cpu >= self.timeout_s


def _exit_description(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return f"process was killed by {name}"
    return f"process exited with code {os.WEXITSTATUS(status)} without an answer"


def serve(in_fd: int, out_fd: int) -> None:
    """The helper's loop: jobs in on `in_fd`, replies out on `out_fd`, one child per job."""
    import xgrammar as xgr  # (seconds) while the scheduler reads the vocabulary

    import services.common.proto.myvllm_pb2  # noqa: F401 - imported once here, not in every child
    import services.common.structured_outputs  # noqa: F401

    stdin = os.fdopen(in_fd, "rb", buffering=0)
    init = _read_frame(stdin)
    if init is None:
        return
    _, info_json = init
    info = xgr.TokenizerInfo.deserialize_json(info_json)
    _lower_priority()  # only now: the start-up itself is not held back
    _write_frame(out_fd, ("ready",))
    my_pid = os.getpid()
    selector = selectors.DefaultSelector()
    os.set_blocking(in_fd, False)
    selector.register(in_fd, selectors.EVENT_READ, None)
    inbox = bytearray()
    running: dict[int, _Running] = {}  # by the fd of the child's reply pipe

    def finish(job: _Running, reply: tuple) -> None:
        selector.unregister(job.fd)
        os.close(job.fd)
        del running[job.fd]
        _write_frame(out_fd, reply)

    try:
        while True:
            now = time.monotonic()
            for job in [j for j in running.values() if j.over_limit(now)]:
                os.kill(job.pid, signal.SIGKILL)
                os.waitpid(job.pid, 0)
                finish(job, ("timeout", job.job_id, job.timeout_s))
            for key, _ in selector.select(CPU_POLL_S if running else None):
                if key.fd == in_fd:
                    data = os.read(in_fd, 1 << 20)
                    if not data:
                        return  # the scheduler went away (the children die with us)
                    inbox.extend(data)
                    for _, job_id, spec_bytes, timeout_s in _frames(inbox):
                        r, w = os.pipe()
                        pid = os.fork()
                        if pid == 0:
                            selector.close()
                            for fd in [in_fd, out_fd, r, *running]:
                                os.close(fd)
                            _die_with_parent(my_pid)
                            _compile_job(info, spec_bytes, job_id, w)
                        os.close(w)
                        running[r] = _Running(job_id, pid, r, timeout_s)
                        selector.register(r, selectors.EVENT_READ, None)
                    continue
                job = running[key.fd]
                data = os.read(job.fd, 1 << 20)
                if data:
                    job.buffer.extend(data)
                    continue
                _, status = os.waitpid(job.pid, 0)
                replies = _frames(job.buffer)
                finish(job, replies[0] if replies else ("crashed", job.job_id, _exit_description(status)))
    finally:
        for job in running.values():
            try:
                os.kill(job.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main() -> None:
    # Replies go out on a private copy of stdout; fd 1 itself goes to stderr, so that nothing
    # xgrammar or transformers print can corrupt a frame.
    out_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C of `serve` stops the scheduler, which stops us
    serve(0, out_fd)


if __name__ == "__main__":
    main()
