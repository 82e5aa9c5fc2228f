"""The services' keepalive settings agree: a client that pings at its keepalive interval over an
idle connection is never told GOAWAY "too_many_pings" by a server with the services' options
(which would break every stream on the connection). Runs in a child process, both ends with
the services' option builders at a 1 s keepalive (the production 10 s, scaled), so that a few
idle intervals fit in seconds; gRPC logs the GOAWAY on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import asyncio, sys
import grpc
from services.common.grpc_utils import channel_options, server_options

KEEPALIVE_MS = 1000

async def main() -> None:
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server = grpc.aio.server(options=server_options(KEEPALIVE_MS))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Echo", {"Call": echo}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options(KEEPALIVE_MS)) as channel:
        call = channel.unary_unary("/t.Echo/Call")
        assert await call(b"before", timeout=5) == b"before"
        await asyncio.sleep(7)  # idle: the client pings every second
        assert await call(b"after", timeout=5) == b"after"
        print("state", channel.get_state(), flush=True)
    await server.stop(None)

asyncio.run(main())
"""


def test_idle_keepalive_pings_are_accepted() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), GRPC_VERBOSITY="ERROR")
    child = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=60)
    assert child.returncode == 0, child.stderr
    assert "too_many_pings" not in child.stderr and "GOAWAY" not in child.stderr, child.stderr
    assert "state ChannelConnectivity.READY" in child.stdout
