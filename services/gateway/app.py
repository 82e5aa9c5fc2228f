"""The gateway's FastAPI app: OpenAI-compatible HTTP in front of one scheduler.

Routes stay thin: each parses its body (pydantic), then hands over to a serving
module (chat, completions) or answers from the tokenizer / scheduler stats.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from services.gateway.body_limit import DEFAULT_MAX_BODY_BYTES, BodySizeLimitMiddleware
from services.gateway.context import GatewayContext
from services.gateway.errors import install_error_handlers, invalid_request, scheduler_unavailable
from services.gateway.prompts import chat_prompt, check_token_ids
from services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from services.gateway.serving_chat import create_chat_completion
from services.gateway.serving_completion import create_completion
from services.gateway.tokenizer import GatewayTokenizer
from services.sdk.client import AsyncClient, SchedulerUnavailable


def _ctx(request: Request) -> GatewayContext:
    return request.app.state.ctx


def create_app(
    scheduler_address: str,
    model_path: str,
    served_model_name: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    scheduler_timeout_s: float = 1.5,
) -> FastAPI:
    """Build the gateway app. The tokenizer loads and the scheduler client is created
    at startup (lifespan); `max_model_len` is fetched from the scheduler in the
    background, and requests arriving while it is unreachable get a 503."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tokenizer = await asyncio.to_thread(GatewayTokenizer.load, model_path)
        client = AsyncClient(scheduler_address, timeout=scheduler_timeout_s)
        ctx = GatewayContext(client, tokenizer, model_path, served_model_name)
        app.state.ctx = ctx
        warmup = asyncio.create_task(ctx.fetch_max_model_len_until_known())
        try:
            yield
        finally:
            warmup.cancel()
            await client.close()

    app = FastAPI(title="my-vllm gateway", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(_ctx(request), body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(_ctx(request), body, request)

    @app.get("/v1/models")
    async def list_models(request: Request) -> ModelList:
        return ModelList(data=[_ctx(request).model_card()])

    @app.get("/v1/models/{model_name:path}")
    async def retrieve_model(model_name: str, request: Request) -> ModelCard:
        ctx = _ctx(request)
        ctx.check_model(model_name)
        return ctx.model_card()

    @app.get("/health")
    async def health(request: Request) -> Response:
        if await _ctx(request).client.health():
            return JSONResponse({"status": "ok"})
        error = scheduler_unavailable(SchedulerUnavailable("the scheduler did not answer its health check"))
        return JSONResponse(error.to_dict(), status_code=HTTPStatus.SERVICE_UNAVAILABLE)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        ctx = _ctx(request)
        try:
            stats = await ctx.client.get_stats()
        except SchedulerUnavailable:
            stats = None  # still report the gateway's own histograms
        return PlainTextResponse(ctx.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        ctx = _ctx(request)
        ctx.check_model(body.model)
        if body.messages is not None:
            tokens = chat_prompt(ctx.tokenizer, body.messages, body.add_generation_prompt,
                                 body.continue_final_message, body.chat_template_kwargs).token_ids
        elif body.prompt is not None:
            tokens = ctx.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise invalid_request("Either prompt or messages is required", param="prompt")
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=await ctx.max_model_len())

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        ctx = _ctx(request)
        ctx.check_model(body.model)
        check_token_ids(body.tokens, ctx.tokenizer.vocab_size, "tokens")
        return DetokenizeResponse(prompt=ctx.tokenizer.decode(body.tokens, skip_special_tokens=False))

    return app


__all__ = ["create_app"]
