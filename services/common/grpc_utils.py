"""Small gRPC helpers shared by the services."""

from __future__ import annotations

import grpc

# Prompts of many thousand tokens and big batches exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 256 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),  # a taken port must fail loudly, not be shared
]


class StartupError(RuntimeError):
    """A service could not start; the message is one line for the user."""


def bind_or_fail(server: grpc.aio.Server, host: str, port: int, what: str) -> None:
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as e:
        raise StartupError(f"{what}: cannot listen on {host}:{port} ({e})") from None
    if bound == 0:
        raise StartupError(f"{what}: cannot listen on {host}:{port} (port in use?)")


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
