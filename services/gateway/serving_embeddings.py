"""POST /v1/embeddings (OpenAI's embeddings API) on an engine that runs the pooling runner.

Each input (a string, or a list of token ids) becomes one engine request carrying
PoolingParams; they go together to one replica (so they share its batch: the scheduler runs them
as prompt-only requests, several per step) and are gathered in input order. An embedding request
is short and produces its one output at the end, so it is not migrated: a replica that fails
mid-request answers 5xx, and the client retries. Admission: the route is one of the generation
paths (services/gateway/admission.py), one slot per HTTP request, its inputs bounded by
--max-choices-per-request as a completions request's prompts are.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from http import HTTPStatus

import numpy as np
from fastapi.responses import Response
from starlette.requests import Request

from services.common.proto import myvllm_pb2 as pb
from services.gateway.context import GatewayContext
from services.gateway.errors import OpenAIError, invalid_request
from services.gateway.generation import DisconnectWatcher, connect_some_replica
from services.gateway.prompts import PromptBound, check_token_ids
from services.gateway.protocol_embeddings import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from services.gateway.router import Replica
from services.gateway.routing import RoutePrompt
from services.gateway.sse import json_response
from services.text.tokenizer import Tokenizer


async def create_embedding(ctx: GatewayContext, request: EmbeddingRequest, http_request: Request | None = None
                           ) -> Response:
    arrival_time = time.monotonic()
    if ctx.check_model(request.model) is not None:  # (a LoRA engine runs the generate runner only)
        raise invalid_request("LoRA adapters serve generation, not embeddings", param="model")
    await ctx.require_runner("pooling")
    items = _input_items(request.input)
    if not items:
        raise invalid_request("input must not be empty", param="input")
    ctx.check_num_choices(len(items), 1)  # before tokenizing any of them
    max_model_len = await ctx.max_model_len()
    prompts = await ctx.in_tokenizer_pool(_tokenize_inputs, ctx.tokenizer, items, request.add_special_tokens,
                                          ctx.prompt_bound(max_model_len))
    pooling = pb.PoolingParams(dimensions=request.dimensions or 0)
    request_id = f"embd-{uuid.uuid4().hex}"
    replica, sent_on = await connect_some_replica(ctx.router, RoutePrompt(prompts[0]))
    tasks = [asyncio.create_task(_embed_one(ctx, replica, f"{request_id}-{i}", ids, pooling, arrival_time))
             for i, ids in enumerate(prompts)]

    async def cancel_all() -> None:  # cancelling a request's task aborts it (its blocks are freed)
        for task in tasks:
            task.cancel()

    watcher = DisconnectWatcher(http_request, cancel_all)  # the client left
    watcher.start()
    try:
        embeddings = await asyncio.gather(*tasks)
    finally:  # (one failed, or the client left: the others end too)
        watcher.stop()
        await cancel_all()
        ctx.router.note_finished(replica, sent_on)
    data = [EmbeddingData(index=i, embedding=base64.b64encode(e).decode("ascii") if request.encoding_format == "base64"
                          else np.frombuffer(e, dtype="<f4").tolist()) for i, e in enumerate(embeddings)]
    num_tokens = sum(len(p) for p in prompts)
    return json_response(EmbeddingResponse(data=data, model=ctx.served_model_name,
                                           usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)))


async def _embed_one(ctx: GatewayContext, replica: Replica, request_id: str, token_ids: list[int],
                     pooling: pb.PoolingParams, arrival_time: float) -> bytes:
    """One input's engine request: its embedding, little-endian float32 bytes (its prompt tokens,
    end-to-end latency and finish reason counted in /metrics like any request's)."""
    sent_on = ctx.router.note_sent(replica)
    timer = ctx.metrics.timer(arrival_time)
    final = None
    try:
        async for output in replica.client.generate(token_ids, pb.SamplingParams(), request_id=request_id,
                                                    dp_wave=ctx.router.dp_wave_for(replica), pooling=pooling):
            final = output
    finally:
        ctx.router.note_finished(replica, sent_on)
    if final is not None and final.finish_reason:
        timer.on_prompt(final.num_prompt_tokens)
        timer.on_finish(final.finish_reason)
    if final is None or final.finish_reason != "stop" or not final.pooled_output:
        reason = final.finish_reason if final is not None else "none"
        raise OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"the engine ended embedding request {request_id} "
                          f"without an embedding (finish_reason {reason!r})", type="internal_server_error")
    return final.pooled_output


def _input_items(value: str | list) -> list[str | list[int]]:
    """OpenAI's four shapes as a list of inputs: a string, strings, token ids, token-id lists."""
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [value]
    return list(value)


def _tokenize_inputs(tokenizer: Tokenizer, items: list[str | list[int]], add_special_tokens: bool,
                     bound: PromptBound) -> list[list[int]]:
    """Token ids of every input (in the tokenizer pool), each checked: not empty, in the
    vocabulary, at most max_model_len tokens (an embedding generates nothing, so the input
    may fill the whole context)."""
    prompts = []
    for i, item in enumerate(items):
        param = "input" if len(items) == 1 else f"input[{i}]"
        if isinstance(item, str):
            bound.check_text(item, param)
            ids = tokenizer.encode(item, add_special_tokens=add_special_tokens)
        else:
            ids = list(item)
            check_token_ids(ids, tokenizer.vocab_size, param)
        if not ids:
            raise invalid_request(f"{param} is empty (no tokens to embed)", param=param)
        if len(ids) > bound.max_model_len:
            raise invalid_request(f"This model's maximum context length is {bound.max_model_len} tokens. However, "
                                  f"{param} has {len(ids)} tokens. Please reduce the length of the input.",
                                  param=param, code="context_length_exceeded")
        prompts.append(ids)
    return prompts
