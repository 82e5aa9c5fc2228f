"""`--root-path`: the path prefix a path-based proxy serves the API under (vLLM's flag, FastAPI's
root_path). The app reports it (OpenAPI's `servers`) and takes a request either way, with the
prefix (a proxy that forwards the path as is) or without it (one that strips it). Every middleware
inside sees the app's own path: the API key, readiness and admission rules match /v1/... and
cannot be stepped around by adding the prefix."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class RootPathMiddleware:
    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = "/" + root_path.strip("/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = dict(scope, root_path=self.root_path)
            path = scope["path"]
            if path == self.root_path or path.startswith(self.root_path + "/"):
                scope["path"] = path[len(self.root_path):] or "/"
                raw = scope.get("raw_path")
                if raw is not None and raw.startswith(self.root_path.encode()):
                    scope["raw_path"] = raw[len(self.root_path):] or b"/"
        await self.app(scope, receive, send)
