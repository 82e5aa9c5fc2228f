"""A service stopped by SIGTERM (or Ctrl-C) stops its gRPC server gracefully: a call in flight
still gets its answer within the grace period, and the process exits without a traceback.
The child process runs a server exactly as the worker and scheduler do (services.entrypoints.cli's stop
signals, asyncio.run, grpc_utils.serve_until_cancelled) with one slow unary method."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from services.common.grpc_utils import SHUTDOWN_GRACE_S

REPO = Path(__file__).resolve().parents[2]
SLOW_CALL_S = SHUTDOWN_GRACE_S / 2  # finishes inside the grace period

CHILD = f"""
import asyncio, logging
import grpc
from services.entrypoints.cli import install_stop_signals
from services.common import grpc_utils

async def slow(request, context):
    await asyncio.sleep({SLOW_CALL_S})
    return request

async def main() -> None:
    server = grpc_utils.server(1 << 20)
    handler = grpc.unary_unary_rpc_method_handler(slow)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Slow", {{"Call": handler}}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await grpc_utils.serve_until_cancelled(server)

logging.basicConfig(level=logging.WARNING)
install_stop_signals()
try:
    asyncio.run(main())
except KeyboardInterrupt:
    pass
"""


def test_sigterm_lets_the_call_in_flight_finish_and_logs_no_traceback() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), GRPC_VERBOSITY="ERROR")
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        port = int(child.stdout.readline())
        answers: list[object] = []
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.Slow/Call")
            assert call(b"warm", timeout=10) == b"warm"  # connected, so the next call starts at once

            def ask() -> None:
                try:
                    answers.append(call(b"in flight", timeout=10))
                except grpc.RpcError as e:
                    answers.append(e.code())

            asker = threading.Thread(target=ask)
            asker.start()
            time.sleep(SLOW_CALL_S / 4)  # the call is being served
            child.send_signal(signal.SIGTERM)
            asker.join(timeout=20)
        assert answers == [b"in flight"]
        assert child.wait(timeout=20) == 0
        stderr = child.stderr.read()
        assert "Traceback" not in stderr and "CancelledError" not in stderr, stderr
    finally:
        child.kill()
        child.wait()
