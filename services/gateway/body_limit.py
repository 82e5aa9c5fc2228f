"""ASGI middleware that refuses request bodies over a size limit with an OpenAI 413.

Pure ASGI (not BaseHTTPMiddleware) so that streaming responses and the
`http.disconnect` message the routes watch for pass through untouched.

A client sends its whole body before it reads the answer. Closing the connection on a body
still arriving makes the kernel answer the unread bytes with a reset, which can reach the
client before the 413 does ("peer closed connection" instead of the error). So the rest of
an oversized body is read and thrown away first, up to `DISCARD_LIMIT_BYTES`; only past that
is the connection closed on a body still coming.
"""

from __future__ import annotations

from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.errors import OpenAIError, error_response

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
# How much of an oversized body is read past the limit (and dropped) before answering 413.
DISCARD_LIMIT_BYTES = 64 * 1024 * 1024


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def _reject(self, scope: Scope, receive: Receive, send: Send, size: str, more_body: bool) -> None:
        if more_body:
            await _discard_body(receive, DISCARD_LIMIT_BYTES)
        error = OpenAIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                            f"Request body too large: {size} bytes exceeds the limit of {self.max_body_bytes} bytes",
                            code="request_too_large")
        response = error_response(error, scope["path"])
        response.headers["connection"] = "close"
        await response(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._reject(scope, receive, send, declared.decode(), more_body=True)
            return
        # Chunked (or mis-declared) bodies: read while counting, then replay to the app.
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await self._reject(scope, receive, send, f"at least {len(body)}",
                                   more_body=message.get("more_body", False))
                return
            if not message.get("more_body", False):
                break

        replayed = False

        async def replay_body() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: only http.disconnect is left to come

        await self.app(scope, replay_body, send)


async def _discard_body(receive: Receive, limit_bytes: int) -> None:
    """Read the request body to its end (or to `limit_bytes`, or the client leaving), dropping it."""
    read = 0
    while read <= limit_bytes:
        message = await receive()
        if message["type"] != "http.request":
            return
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
