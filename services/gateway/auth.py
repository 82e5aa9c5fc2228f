"""`--api-key`: clients must present the key on the /v1 routes, as `Authorization: Bearer <key>`
(OpenAI's clients) or `x-api-key: <key>` (Anthropic's clients).

As with `vllm serve --api-key`, only paths under /v1 are guarded; /health, /metrics,
/tokenize and /detokenize stay open. A missing or wrong key is a 401 in the route's error
shape (OpenAI's, or Anthropic's on /v1/messages), before the body is read.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from http import HTTPStatus

from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.errors import OpenAIError, error_response


class ApiKeyMiddleware:
    """`api_key`: one key, or several (vLLM's --api-key k1 k2), any of which a client may present."""

    def __init__(self, app: ASGIApp, api_key: str | Sequence[str]) -> None:
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else list(api_key)
        self._expected = [f"Bearer {key}".encode() for key in keys]
        self._expected_keys = [key.encode() for key in keys]

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        # Constant-time comparisons: a key must not leak through response timing, so every key is
        # compared (no early exit). Either header may carry it (a client sending both needs only
        # one right).
        bearer, key = headers.get(b"authorization", b""), headers.get(b"x-api-key", b"")
        matches = [hmac.compare_digest(bearer, expected) for expected in self._expected]
        matches += [hmac.compare_digest(key, expected) for expected in self._expected_keys]
        return any(matches)

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
