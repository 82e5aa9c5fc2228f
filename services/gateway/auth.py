"""`--api-key`: clients must present `Authorization: Bearer <key>` on the OpenAI routes.

As with `vllm serve --api-key`, only paths under /v1 are guarded; /health, /metrics,
/tokenize and /detokenize stay open. A missing or wrong key is a 401 in OpenAI's error
shape, before the body is read.
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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            # Constant-time comparison: the key must not leak through response timing.
            if not hmac.compare_digest(given, self._expected):
                error = OpenAIError(HTTPStatus.UNAUTHORIZED,
                                    "Incorrect API key provided" if given else "Missing API key (expected an "
                                    "'Authorization: Bearer <key>' header)", code="invalid_api_key")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
