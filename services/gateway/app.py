"""The gateway's FastAPI app: OpenAI-compatible HTTP in front of one or more engine
replicas (schedulers), picked per request by the router.

Routes stay thin: each parses its body (pydantic), then hands over to a serving
module (chat, completions) or answers from the tokenizer / scheduler stats.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from http import HTTPStatus
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles

from services.gateway.admission import AdmissionController, AdmissionMiddleware
from services.gateway.auth import ApiKeyMiddleware
from services.gateway.body_limit import DEFAULT_MAX_BODY_BYTES, BodySizeLimitMiddleware
from services.gateway.context import GatewayContext
from services.gateway.cors import add_cors
from services.gateway.errors import (
    OpenAIError,
    error_response,
    install_error_handlers,
    invalid_request,
    unavailable,
    unsupported,
)
from services.gateway.lora_registry import LoraRegistry, runtime_updates_allowed
from services.gateway.lora_routes import add_lora_routes
from services.gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from services.gateway.options import GatewayOptions
from services.gateway.prompts import PromptBound, chat_prompt, check_token_ids
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
from services.gateway.protocol_anthropic import CountTokensRequest, CountTokensResponse, MessagesRequest
from services.gateway.protocol_embeddings import EmbeddingRequest
from services.gateway.protocol_responses import ResponsesRequest
from services.gateway.readiness import ReadinessMiddleware
from services.gateway.request_defaults import RequestDefaults, generation_config_defaults
from services.gateway.request_fields import check_request_fields
from services.gateway.root_path import RootPathMiddleware
from services.gateway.router import ReplicaRouter
from services.gateway.serving_chat import create_chat_completion
from services.gateway.serving_completion import create_completion
from services.gateway.serving_embeddings import create_embedding
from services.gateway.serving_messages import count_tokens, create_message
from services.gateway.serving_responses import ResponseStore, create_response, delete_response, retrieve_response
from services.gateway.stats_log import log_stats_forever, log_stats_interval
from services.text.tokenizer import Tokenizer, load_chat_template

STATIC_DIR = Path(__file__).with_name("static")  # the playground page at /


def _ctx(request: Request) -> GatewayContext:
    return request.app.state.ctx


def create_app(
    scheduler_addresses: str | Sequence[str],
    model_path: str,
    served_model_name: str | Sequence[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    scheduler_timeout_s: float = 1.5,
    redis_url: str | None = None,
    options: GatewayOptions | None = None,
) -> FastAPI:
    """Build the gateway app for the schedulers at `scheduler_addresses` (one address, a
    comma-separated list or a sequence) plus, with `redis_url`, every replica publishing
    its load there. The tokenizer loads and the scheduler clients are created at startup
    (lifespan); `max_model_len` is fetched from a scheduler in the background, and `/v1/*`
    requests get a 503 until a replica is routable (readiness.py). `options`: limits, migration, credentials;
    `app.state.admission` is the admission controller (the server drains it on SIGTERM).
    `served_model_name`: one name or several (the first is reported). ValueError: a
    --generation-config that cannot be read."""
    addresses = split_addresses(scheduler_addresses)
    options = options or GatewayOptions()
    admission = AdmissionController(options.max_concurrent_requests, options.max_queued_requests)
    lora = LoraRegistry(options.lora_modules, options.lora_root)  # a bad adapter stops start-up, naming it
    request_defaults = RequestDefaults(generation_config_defaults(options.generation_config, model_path),
                                       options.max_logprobs, options.response_role)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tokenizer = await asyncio.to_thread(Tokenizer.load, model_path, options.tokenizer)
        if options.chat_template is not None:
            tokenizer.chat_template = load_chat_template(options.chat_template)
        router = ReplicaRouter(addresses, redis_url=redis_url, timeout_s=scheduler_timeout_s,
                               internal_token=options.internal_token, routing=options.routing)
        ctx = GatewayContext(router, tokenizer, model_path, served_model_name, options.migration, options.tools,
                             options.max_choices_per_request, options.limits, options.tokenizer_pool_size,
                             request_defaults, options.enable_log_requests,
                             lora)
        app.state.ctx = ctx
        router.start()
        warmup = asyncio.create_task(ctx.fetch_max_model_len_until_known())
        background = [warmup]
        if not options.disable_log_stats:
            background.append(asyncio.create_task(log_stats_forever(router.replica_stats, log_stats_interval())))
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await router.close()
            ctx.close()

    app = FastAPI(title="my-vllm gateway", lifespan=lifespan)
    app.state.admission = admission
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes)
    app.add_middleware(AdmissionMiddleware, controller=admission)
    app.add_middleware(ReadinessMiddleware, state=app.state)  # before admission: a refusal takes no slot
    if options.api_keys:
        app.add_middleware(ApiKeyMiddleware, api_key=options.api_keys)  # before any work
    if options.root_path:
        app.add_middleware(RootPathMiddleware, root_path=options.root_path)  # (before any path is matched)
    add_cors(app, options.cors)  # outermost (cors.py says why)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_request_fields(body, options.strict_request_fields)
        return await create_chat_completion(_ctx(request), body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_request_fields(body, options.strict_request_fields)
        return await create_completion(_ctx(request), body, request)

    # Embeddings: an engine started with --runner pooling (else a 400 naming the flag).
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await create_embedding(_ctx(request), body, request)

    # OpenAI's Responses API; previous_response_id reads this app's in-memory store.
    app.state.responses = ResponseStore()

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(_ctx(request), request.app.state.responses, body, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> Response:
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise unsupported("Streaming a stored response again", param="stream")  # (it has finished)
        return retrieve_response(request.app.state.responses, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def remove_response(response_id: str, request: Request) -> Response:
        return delete_response(request.app.state.responses, response_id)

    # Anthropic's Messages API (its errors in Anthropic's shape: errors.error_body).
    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await create_message(_ctx(request), body, request)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(body: CountTokensRequest, request: Request) -> CountTokensResponse:
        return await count_tokens(_ctx(request), body)

    @app.get("/v1/models")
    async def list_models(request: Request) -> ModelList:
        ctx = _ctx(request)
        return ModelList(data=ctx.model_cards())

    @app.get("/v1/models/{model_name:path}")
    async def retrieve_model(model_name: str, request: Request) -> ModelCard:
        ctx = _ctx(request)
        ctx.check_model(model_name)
        return ctx.model_card(model_name if model_name in ctx.served_model_names or ctx.lora.get(model_name)
                              else None)

    if runtime_updates_allowed():
        add_lora_routes(app, _ctx)

    @app.get("/health")
    async def health(request: Request) -> Response:
        if admission.draining:  # load balancers: send new work elsewhere
            return error_response(OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, "The server is shutting down",
                                              type="service_unavailable_error", code="shutting_down"))
        if await _ctx(request).router.healthy():
            return JSONResponse({"status": "ok"})
        return error_response(unavailable("The engine is unavailable: no replica answered its health check",
                                          "scheduler_unavailable"))

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        ctx = _ctx(request)
        stats = await ctx.router.stats()  # None when no scheduler answers: still the gateway's own histograms
        text = ctx.metrics.render(stats, ctx.router.routed, ctx.router.routable(),
                                  admission_rejections=admission.num_rejected_queue_full)
        return PlainTextResponse(text, media_type=METRICS_CONTENT_TYPE)

    # The playground page (static/: plain HTML/CSS/JS). Outside /v1, so --api-key does not guard
    # it: the page asks for the key and sends it on its own /v1 calls.
    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        ctx = _ctx(request)
        ctx.check_model(body.model)
        if body.messages is None and body.prompt is None:
            raise invalid_request("Either prompt or messages is required", param="prompt")
        if body.messages is not None:
            ctx.limits.check_messages(body.messages)
        max_model_len = await ctx.max_model_len()
        bound = ctx.prompt_bound(max_model_len)
        if body.messages is not None:
            tokens = (await ctx.in_tokenizer_pool(chat_prompt, ctx.tokenizer, body.messages, body.add_generation_prompt,
                                                  body.continue_final_message, body.chat_template_kwargs,
                                                  bound=bound)).token_ids
        else:
            tokens = await ctx.in_tokenizer_pool(_tokenize_text, ctx.tokenizer, body.prompt, body.add_special_tokens,
                                                 bound)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=max_model_len)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        ctx = _ctx(request)
        ctx.check_model(body.model)
        return DetokenizeResponse(prompt=await ctx.in_tokenizer_pool(_detokenize, ctx.tokenizer, body.tokens))

    return app


def _tokenize_text(tokenizer: Tokenizer, text: str, add_special_tokens: bool, bound: PromptBound) -> list[int]:
    bound.check_text(text, "prompt")
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _detokenize(tokenizer: Tokenizer, tokens: list[int]) -> str:
    check_token_ids(tokens, tokenizer.vocab_size, "tokens")
    return tokenizer.decode(tokens, skip_special_tokens=False)


def split_addresses(addresses: str | Sequence[str]) -> list[str]:
    """"a:1,b:2" or ["a:1", "b:2"] → ["a:1", "b:2"] (blanks dropped)."""
    items = addresses.split(",") if isinstance(addresses, str) else addresses
    return [a.strip() for a in items if a.strip()]


__all__ = ["create_app", "split_addresses"]
