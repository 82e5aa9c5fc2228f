"""Small gRPC helpers shared by the services: channel/server options, binding, channels."""

from __future__ import annotations

import asyncio

import grpc

# What a receiver accepts is sized per link from the largest legal message (message_limits.py)
# and passed to server() / channel(); what a peer sends is not limited (gRPC's default).
# Keepalive: a peer that vanished without closing its TCP connection (power loss, a network
# partition, a SIGSTOPped process whose kernel still ACKs) is noticed within about
# KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS instead of never. A hung-but-connected worker is
# a different failure: the scheduler's --engine-timeout covers that.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000


def server_options(keepalive_time_ms: int = KEEPALIVE_TIME_MS) -> list[tuple[str, object]]:
    """A server's options. It must accept its clients' keepalive pings even on an idle
    connection, or after two pings too early it answers GOAWAY (ENHANCE_YOUR_CALM,
    "too_many_pings") and every stream on the connection breaks. gRPC's own default for the
    shortest ping interval without data is five minutes."""
    return _common_options(keepalive_time_ms) + [
        ("grpc.so_reuseport", 0),  # a taken port must fail loudly, not be shared
        # (grpc.h: GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS)
        ("grpc.http2.min_ping_interval_without_data_ms", keepalive_time_ms // 2),
    ]


def channel_options(keepalive_time_ms: int = KEEPALIVE_TIME_MS) -> list[tuple[str, object]]:
    return _common_options(keepalive_time_ms) + [
        # A restarted peer should be found again within about a second, not after gRPC's
        # default exponential backoff (which grows to two minutes).
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


def _common_options(keepalive_time_ms: int) -> list[tuple[str, object]]:
    return [
        ("grpc.keepalive_time_ms", keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


SERVER_OPTIONS = server_options()
CHANNEL_OPTIONS = channel_options()
# Deadline of a unary call between services (Health, GetLoad, KV sizing). LoadModel and
# InitKVCache read weights / allocate tensors and get their own, longer deadline.
UNARY_TIMEOUT_S = 10.0
SETUP_TIMEOUT_S = 300.0
# A stopping service lets calls in flight end for this long before it cancels them.
SHUTDOWN_GRACE_S = 1.0


class StartupError(RuntimeError):
    """A service could not start; the message is one line for the user."""


def bind_or_fail(server: grpc.aio.Server, host: str, port: int, what: str) -> None:
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as e:
        raise StartupError(f"{what}: cannot listen on {host}:{port} ({e})") from None
    if bound == 0:
        raise StartupError(f"{what}: cannot listen on {host}:{port} (port in use?)")


def _receive_limit(max_receive_bytes: int) -> list[tuple[str, object]]:
    # -1: no limit (gRPC's own default is 4 MiB, below a long prompt's request).
    return [("grpc.max_receive_message_length", max_receive_bytes)]


def server(max_receive_bytes: int, interceptors: list | None = None) -> grpc.aio.Server:
    """A grpc.aio server with the shared options, refusing (RESOURCE_EXHAUSTED) any message
    above `max_receive_bytes` before reading it, and, when given, auth interceptors."""
    return grpc.aio.server(options=SERVER_OPTIONS + _receive_limit(max_receive_bytes),
                           interceptors=interceptors or None)


async def serve_until_cancelled(server: grpc.aio.Server, grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Serve until this task is cancelled (Ctrl-C / SIGTERM cancel asyncio.run's main task),
    then stop: calls in flight get `grace_s` to finish before they are cancelled.

    The shield matters: grpc.aio's wait_for_termination() awaits the server's own shutdown
    future, so cancelling it cancels that future, and stop() then raises CancelledError at
    once: no grace, and asyncio.run's clean-up cancels the RPC tasks still open, which grpc
    logs as tracebacks ("Exception not handled by _handle_exceptions ... CancelledError")."""
    try:
        await asyncio.shield(server.wait_for_termination())
    finally:
        await server.stop(grace_s)


def channel(address: str, max_receive_bytes: int) -> grpc.aio.Channel:
    """A channel with the shared options that reads answers of up to `max_receive_bytes`."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS + _receive_limit(max_receive_bytes))


def sync_channel(address: str, max_receive_bytes: int) -> grpc.Channel:
    """`channel`'s blocking twin, for threads outside an event loop (a worker's KV transfers)."""
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS + _receive_limit(max_receive_bytes))


def cancelled_from_outside() -> bool:
    """Whether the running task is being cancelled (its owner closed it, the client went away,
    the server stops). An asyncio.CancelledError without that came from below: gRPC raises it in
    a call whose channel was closed under it. Such a CancelledError is a failure like any other,
    to be reported or recovered from, not a reason to stop."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
