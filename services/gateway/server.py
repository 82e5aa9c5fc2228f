"""Running the gateway: `serve_gateway` for the CLI, `BackgroundGateway` for tests.

We bind the listening socket ourselves and hand it to uvicorn: uvicorn answers a busy
port by logging and calling sys.exit, while the CLI wants one clear error line.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys
import threading
import time

import uvicorn

from services.common.grpc_utils import StartupError
from services.gateway.app import create_app
from services.gateway.body_limit import DEFAULT_MAX_BODY_BYTES


class PortInUseError(StartupError):
    """The gateway's port is taken by another process."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0 = any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUseError(f"gateway: cannot listen on {host}:{port} (port already in use)") from None
        raise StartupError(f"gateway: cannot listen on {host}:{port} ({e.strerror})") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(host: str, port: int, scheduler_address: str, model_path: str,
                    served_model_name: str | None, log_level: str, max_body_bytes: int,
                    redis_url: str | None = None) -> uvicorn.Server:
    app = create_app(scheduler_address, model_path, served_model_name, max_body_bytes=max_body_bytes,
                     redis_url=redis_url)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


def serve_gateway(host: str, port: int, scheduler_address: str, model_path: str,
                  served_model_name: str | None = None, log_level: str = "warning",
                  max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, redis_url: str | None = None) -> None:
    """Serve the OpenAI-compatible gateway until interrupted (blocking). `scheduler_address`
    may list several replicas (comma-separated); `redis_url` adds the ones publishing there.

    Raises `PortInUseError` if the port is taken, `StartupError` for other start failures
    (both one-line messages for the CLI).
    """
    sock = bind_socket(host, port)
    server = _uvicorn_server(host, port, scheduler_address, model_path, served_model_name, log_level,
                             max_body_bytes, redis_url)
    server.run(sockets=[sock])
    if not server.started:  # uvicorn logs the cause (e.g. no tokenizer in model_path) and returns
        raise StartupError(f"gateway: failed to start (see the log above; model {model_path})")


class BackgroundGateway:
    """A gateway served from a background thread on a free port (for tests)."""

    def __init__(self, scheduler_address: str, model_path: str, served_model_name: str | None = None,
                 host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, redis_url: str | None = None) -> None:
        self._sock = bind_socket(host, port)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._server = _uvicorn_server(host, self.port, scheduler_address, model_path, served_model_name,
                                       log_level, max_body_bytes, redis_url)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="myvllm-gateway", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

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

    parser = argparse.ArgumentParser(description="my-vllm OpenAI-compatible gateway")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--scheduler", default="127.0.0.1:50051",
                        help="scheduler gRPC address; several (comma-separated) = data-parallel replicas")
    parser.add_argument("--redis", default=None, help="redis URL: also route to replicas publishing there")
    parser.add_argument("--model", default=default_model_path(), help="HF model directory (tokenizer)")
    parser.add_argument("--served-model-name", default=None)
    args = parser.parse_args(argv)
    try:
        serve_gateway(args.host, args.port, args.scheduler, args.model, args.served_model_name,
                      redis_url=args.redis)
    except StartupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
