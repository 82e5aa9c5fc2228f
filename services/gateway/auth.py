"""`--api-key`: clients must present the key on the /v1 routes, as `Authorization: Bearer <key>`
(OpenAI's clients) or `x-api-key: <key>` (Anthropic's clients).

As with `vllm serve --api-key`, only paths under /v1 are guarded; /health, /metrics,
/tokenize and /detokenize stay open. A missing or wrong key is a 401 in the route's error
shape (OpenAI's, or Anthropic's on /v1/messages), before the body is read.
"""

from __future__ import annotations

import hmac
from http import HTTPStatus

from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.errors import OpenAIError, error_response


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._expected_key = api_key.encode()

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        # Constant-time comparisons: the key must not leak through response timing. Either
        # header may carry it (a client sending both needs only one right).
        bearer_ok = hmac.compare_digest(headers.get(b"authorization", b""), self._expected)
        key_ok = hmac.compare_digest(headers.get(b"x-api-key", b""), self._expected_key)
        return bearer_ok or key_ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            headers = dict(scope["headers"])
            if not self._authorized(headers):
                given = bool(headers.get(b"authorization") or headers.get(b"x-api-key"))
                error = OpenAIError(HTTPStatus.UNAUTHORIZED,
                                    "Incorrect API key provided" if given else "Missing API key (expected an "
                                    "'Authorization: Bearer <key>' or 'x-api-key: <key>' header)",
                                    code="invalid_api_key")
                await error_response(error, scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)
