"""CORS, as `vllm serve` sets it up: Starlette's CORSMiddleware with --allowed-origins,
--allowed-methods, --allowed-headers and --allow-credentials (default: any origin, method and
header; no credentials), so a browser page on another origin can call the API."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware


@dataclass(frozen=True)
class CorsSettings:
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


def add_cors(app: FastAPI, cors: CorsSettings) -> None:
    """The middleware, added last so that it is outermost: every answer carries its headers, a
    401 from --api-key included (a browser page can then read why), and a preflight OPTIONS is
    answered before any other middleware sees it."""
    app.add_middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                       allow_methods=list(cors.allowed_methods), allow_headers=list(cors.allowed_headers),
                       allow_credentials=cors.allow_credentials)
