"""Running the gateway: `serve_gateway` for the CLI, `BackgroundGateway` for tests.

We bind the socket ourselves and hand it to uvicorn: uvicorn answers a busy port by
logging and calling sys.exit, while the CLI wants one clear error line. It is bound but not
listening until the app has started (uvicorn listens then): while the tokenizer loads, a
client's connection is refused, as by a vLLM server before its engine is up, instead of
sitting unanswered in the backlog. From then on, `/v1/*` answers 503 with Retry-After
until an engine replica is routable (readiness.py).

SIGTERM (or Ctrl-C) drains: the socket stays open so new requests get a clear 503,
in-flight ones run to the end (at most --shutdown-timeout seconds), then uvicorn shuts
down. A second signal stops at once.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType

import uvicorn
from fastapi import FastAPI

from services.common.grpc_utils import StartupError
from services.gateway.admission import AdmissionController
from services.gateway.app import create_app
from services.gateway.body_limit import DEFAULT_MAX_BODY_BYTES
from services.gateway.options import GatewayOptions, add_gateway_options, gateway_options


class PortInUseError(StartupError):
    """The gateway's port is taken by another process."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (port 0 = any free port), not yet listening: the server
    listens once the app has started, so no connection waits unanswered meanwhile.

    Made with proto=IPPROTO_TCP: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    connections whose socket says so, and a proto-0 socket's do not. With Nagle on, a stream's
    first event (written right after the response headers) waited for the client's ACK of the
    headers, which a client that had just received a response delays by up to 40 ms: every
    request sent right after another got its first token ~40 ms late (bench serve at
    concurrency 1). The listener itself is NODELAY too, which accepted sockets inherit."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUseError(f"gateway: cannot listen on {host}:{port} (port already in use)") from None
        raise StartupError(f"gateway: cannot listen on {host}:{port} ({e.strerror})") from None
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn, with a drain before its shutdown: the first signal stops admitting requests
    and waits (up to `shutdown_timeout_s`) until the in-flight ones are done."""

    def __init__(self, config: uvicorn.Config, admission: AdmissionController, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.admission = admission
        self.shutdown_timeout_s = shutdown_timeout_s
        self._drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_deadline is not None or self.should_exit:
            super().handle_exit(sig, frame)  # a second signal: stop now
            return
        self._captured_signals.append(sig)  # re-raised by uvicorn once it has shut down
        self.admission.start_draining()
        self._drain_deadline = time.monotonic() + self.shutdown_timeout_s

    async def on_tick(self, counter: int) -> bool:
        if self._drain_deadline is not None and not self.should_exit:
            if self.admission.num_in_flight == 0 or time.monotonic() >= self._drain_deadline:
                self.should_exit = True
        return await super().on_tick(counter)


# How long an idle keep-alive connection stays open. httpx (the openai and anthropic clients) drops
# its idle connections after 5 s, uvicorn's default is also 5 s: with equal timers a client can send
# a request on a connection in the very moment the server closes it, and on a busy machine that
# moment widens into a visible "Connection error". Outliving the clients' timer leaves the close to
# them.
IDLE_KEEP_ALIVE_S = 15


def _uvicorn_server(host: str, port: int, scheduler_address: str, model_path: str,
                    served_model_name: str | Sequence[str] | None, log_level: str | None, max_body_bytes: int,
                    redis_url: str | None = None, options: GatewayOptions | None = None) -> DrainingServer:
    """`log_level`: uvicorn's (None: --uvicorn-log-level's, in `options`)."""
    options = options or GatewayOptions()
    app = create_app(scheduler_address, model_path, served_model_name, max_body_bytes=max_body_bytes,
                     redis_url=redis_url, options=options)
    # The drain already waited for requests: uvicorn's own grace is only for the last bytes.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level or options.uvicorn_log_level,
                            access_log=not options.disable_uvicorn_access_log, timeout_graceful_shutdown=2,
                            timeout_keep_alive=IDLE_KEEP_ALIVE_S)
    return DrainingServer(config, app.state.admission, options.shutdown_timeout_s)


def serve_gateway(host: str, port: int, scheduler_address: str, model_path: str,
                  served_model_name: str | Sequence[str] | None = None, log_level: str | None = None,
                  max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, redis_url: str | None = None,
                  options: GatewayOptions | None = None) -> None:
    """Serve the OpenAI-compatible gateway until interrupted (blocking). `scheduler_address`
    may list several replicas (comma-separated); `redis_url` adds the ones publishing there.

    Raises `PortInUseError` if the port is taken, `StartupError` for other start failures
    (both one-line messages for the CLI).
    """
    sock = bind_socket(host, port)
    server = _uvicorn_server(host, port, scheduler_address, model_path, served_model_name, log_level,
                             max_body_bytes, redis_url, options)
    server.run(sockets=[sock])
    if not server.started:  # uvicorn logs the cause (e.g. no tokenizer in model_path) and returns
        raise StartupError(f"gateway: failed to start (see the log above; model {model_path})")


class BackgroundGateway:
    """A gateway served from a background thread on a free port (for tests)."""

    def __init__(self, scheduler_address: str, model_path: str, served_model_name: str | Sequence[str] | None = None,
                 host: str = "127.0.0.1", port: int = 0, log_level: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, redis_url: str | None = None,
                 options: GatewayOptions | None = None) -> None:
        self._sock = bind_socket(host, port)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._server = _uvicorn_server(host, self.port, scheduler_address, model_path, served_model_name,
                                       log_level, max_body_bytes, redis_url, options)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="myvllm-gateway", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def app(self) -> FastAPI:
        """The served app (tests look at its state, e.g. the router)."""
        return self._server.config.app

    def start(self, timeout_s: float = 60.0) -> BackgroundGateway:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()

    def __enter__(self) -> BackgroundGateway:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """`python -m services.gateway.server --scheduler HOST:PORT --model DIR`."""
    from services.common.config import default_model_path
    from services.common.redis_registry import redis_url_from_env

    parser = argparse.ArgumentParser(description="my-vllm OpenAI-compatible gateway", allow_abbrev=False)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--scheduler", default="127.0.0.1:50051",
                        help="scheduler gRPC address; several (comma-separated) = data-parallel replicas")
    parser.add_argument("--redis", default=None,
                        help="redis URL: also route to replicas publishing there (default: $MYVLLM_REDIS_URL)")
    parser.add_argument("--model", default=default_model_path(), help="HF model directory (tokenizer)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="the model's name(s) in the API (the first is reported; default: the directory's name)")
    add_gateway_options(parser)
    args = parser.parse_args(argv)
    try:
        serve_gateway(args.host, args.port, args.scheduler, args.model, args.served_model_name,
                      redis_url=redis_url_from_env(args.redis), options=gateway_options(args))
    except (StartupError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
