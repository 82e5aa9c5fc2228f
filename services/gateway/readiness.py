"""Start-up readiness: no `/v1/*` route answers until an engine replica is routable.

Clients and load balancers probe a vLLM server with `GET /v1/models` and send work once it
answers; a gateway that answered before it could route (a model card without max_model_len,
then a 503 on the first completion) would mislead them. Until `GatewayContext.ready()`, every
`/v1/*` request gets a fast 503 with `Retry-After` (Anthropic's error shape on its routes);
`/health`, `/metrics`, the playground page and the tokenizer routes answer as before.
Before the app itself has started (tokenizer loading), the port does not listen at all
(services/gateway/server.py).
"""

from __future__ import annotations

from fastapi.datastructures import State
from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.errors import error_response, unavailable

GATED_PREFIX = "/v1/"
NOT_READY_MESSAGE = "The server is starting: no engine replica is ready yet"


class ReadinessMiddleware:
    """Answers `/v1/*` with 503 + Retry-After until the app's `GatewayContext` is ready
    (`state.ctx`, set by the app's start-up)."""

    def __init__(self, app: ASGIApp, state: State) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(GATED_PREFIX) and not await self.state.ctx.ready():
            await error_response(unavailable(NOT_READY_MESSAGE, "server_starting"), scope["path"])(scope, receive, send)
            return
        await self.app(scope, receive, send)
