"""The internal shared token: who may call a worker or a scheduler.

Workers and schedulers have no business being called by anyone but the mesh itself
(LoadModel reads files, InitKVCache allocates memory). When a token is configured
(`--internal-token` or $MYVLLM_INTERNAL_TOKEN), every RPC must carry it in the gRPC
metadata key `x-myvllm-token`; anything else is refused with UNAUTHENTICATED.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable

import grpc

TOKEN_ENV = "MYVLLM_INTERNAL_TOKEN"
TOKEN_METADATA_KEY = "x-myvllm-token"


def token_from_env(token: str | None = None) -> str | None:
    """An explicit token wins; else $MYVLLM_INTERNAL_TOKEN; empty means none."""
    if token is None:
        token = os.environ.get(TOKEN_ENV)
    return token or None


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a client sends with every call (nothing when there is no token)."""
    return ((TOKEN_METADATA_KEY, token),) if token else ()


def _refusing_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts with UNAUTHENTICATED."""

    async def abort_unary(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def abort_stream(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    codec = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(abort_unary, **codec)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(abort_stream, **codec)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(abort_unary, **codec)
    return grpc.stream_stream_rpc_method_handler(abort_stream, **codec)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose `x-myvllm-token` metadata is not the configured token."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("TokenAuthInterceptor needs a non-empty token")
        self._token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        sent = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_METADATA_KEY)
        handler = await continuation(handler_call_details)
        if sent is None:
            reason = f"missing internal token (gRPC metadata {TOKEN_METADATA_KEY!r}; see --internal-token)"
        elif not hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent, self._token):
            reason = "wrong internal token"
        else:
            return handler
        if handler is None:
            return None  # an unknown method: gRPC answers UNIMPLEMENTED, which reveals nothing
        return _refusing_handler(handler, reason)


def server_interceptors(token: str | None) -> list[grpc.aio.ServerInterceptor]:
    """What a worker or scheduler server installs: the token check when a token is set."""
    return [TokenAuthInterceptor(token)] if token else []
