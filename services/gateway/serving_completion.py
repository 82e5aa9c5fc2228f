"""POST /v1/completions (the legacy text-completions API)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi.responses import Response
from starlette.requests import Request

from services.common.sampling_params import MAX_LOGPROBS
from services.common.structured_outputs import StructuredOutputsParams
from services.gateway.context import GatewayContext
from services.gateway.errors import as_openai_error, invalid_request, unsupported
from services.gateway.generation import PromptSampling, fan_out, request_ids, start_routed
from services.gateway.logprobs import CompletionLogprobsBuilder, vllm_prompt_logprobs
from services.gateway.prompts import EnginePrompt, completion_prompts, num_prompts, prompt_truncation
from services.gateway.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprobs,
    UsageInfo,
)
from services.gateway.sampling import build_sampling_params, check_context_length, check_prompt_logprobs_not_streamed
from services.gateway.sse import DONE, json_response, sse_event, sse_response
from services.gateway.structured_outputs import request_structured_outputs
from services.text.output_processor import ChoiceDelta


async def create_completion(ctx: GatewayContext, request: CompletionRequest,
                            http_request: Request | None = None) -> Response:
    arrival_time = time.monotonic()
    lora_request = ctx.check_model(request.model)
    if (field := request.unsupported_field()) is not None:
        raise unsupported(field)
    if request.logprobs is not None and not 0 <= request.logprobs <= MAX_LOGPROBS:
        raise invalid_request(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {request.logprobs}",
                              param="logprobs")
    check_prompt_logprobs_not_streamed(request)
    # echo + logprobs (OpenAI) needs the prompt's logprobs too; so does vLLM's prompt_logprobs.
    wanted = [k for k in (request.prompt_logprobs, request.logprobs if request.echo else None) if k is not None]
    engine_prompt_logprobs = max(wanted) if wanted else None
    ctx.check_num_choices(num_prompts(request.prompt), request.n)  # before tokenizing any of them
    ctx.limits.check_stop(request.stop)
    structured_outputs = await asyncio.to_thread(request_structured_outputs, request)  # parsing: off the loop
    max_model_len = await ctx.max_model_len()
    # Tokenizing (and decoding token-id prompts for echo, and the bad words' tokens): in the tokenizer pool.
    prompts, sampled = await ctx.in_tokenizer_pool(_prompts_and_sampling, ctx, request, structured_outputs,
                                                   engine_prompt_logprobs, max_model_len)

    ids = request_ids("cmpl", request.request_id)
    ctx.log_request(ids.response, sampled)
    choices = fan_out(ids.engine, sampled, ctx.tokenizer, request.priority, request.cache_salt or "", lora_request)
    deltas = await start_routed(ctx.router, choices, ctx.metrics, http_request, arrival_time, ctx.migration)
    writer = _CompletionWriter(ctx, request, ids.response, prompts, request.n)
    if request.stream:
        return sse_response(writer.stream(deltas))
    return json_response(await writer.collect(deltas))


def _prompts_and_sampling(ctx: GatewayContext, request: CompletionRequest,
                          structured_outputs: StructuredOutputsParams | None, engine_prompt_logprobs: int | None,
                          max_model_len: int) -> tuple[list[EnginePrompt], list[PromptSampling]]:
    truncation = prompt_truncation(request.truncate_prompt_tokens, request.truncation_side, max_model_len)
    prompts = completion_prompts(ctx.tokenizer, request.prompt, request.add_special_tokens,
                                 bound=ctx.prompt_bound(max_model_len), truncation=truncation)
    sampled = []
    for prompt in prompts:
        # max_tokens defaults to 16; null lets each prompt use whatever context it leaves.
        check_context_length(request.max_tokens, len(prompt.token_ids), max_model_len, "prompt")
        params, sampling = build_sampling_params(request, ctx.tokenizer, request.max_tokens, request.logprobs,
                                                 prompt_logprobs=engine_prompt_logprobs,
                                                 structured_outputs=structured_outputs, defaults=ctx.request_defaults)
        sampled.append(PromptSampling(prompt.token_ids, params, sampling))
    return prompts, sampled


class _CompletionWriter:
    """Shapes one completion request's deltas as OpenAI responses or chunks."""

    def __init__(self, ctx: GatewayContext, request: CompletionRequest, request_id: str,
                 prompts: list[EnginePrompt], n: int) -> None:
        self._ctx = ctx
        self._request = request
        self._id = request_id
        self._created = int(time.time())
        self._num_choices = len(prompts) * n
        self._prompt_of_choice = [prompts[i // n] for i in range(self._num_choices)]
        self._num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        self._num_completion_tokens = 0
        self._echo_pending = [request.echo] * self._num_choices
        self._echo_logprobs_pending = [request.echo] * self._num_choices
        as_token_ids = bool(request.return_tokens_as_token_ids)
        self._logprobs = [CompletionLogprobsBuilder(ctx.tokenizer, request.logprobs, as_token_ids=as_token_ids)
                          if request.logprobs is not None else None for _ in range(self._num_choices)]
        self._prompt_logprobs: list[PromptLogprobs | None] = [None] * self._num_choices
        self._return_token_ids = bool(request.return_token_ids)
        # return_token_ids while streaming: a choice's first chunk carries its prompt's ids.
        self._prompt_ids_pending = [self._return_token_ids] * self._num_choices

    def _stream_prompt_token_ids(self, index: int) -> list[int] | None:
        if not self._prompt_ids_pending[index]:
            return None
        self._prompt_ids_pending[index] = False
        return self._prompt_of_choice[index].token_ids

    def _text(self, delta: ChoiceDelta) -> str:
        if self._echo_pending[delta.index]:
            self._echo_pending[delta.index] = False
            return self._prompt_of_choice[delta.index].text + delta.text
        return delta.text

    def _delta_logprobs(self, delta: ChoiceDelta) -> CompletionLogprobs | None:
        builder = self._logprobs[delta.index]
        if builder is None:
            return None
        if not (self._echo_logprobs_pending[delta.index] and delta.token_ids):
            return builder.build(delta.token_ids, delta.logprobs)
        # The first tokens: the echoed prompt's logprobs come first (they arrive with them).
        self._echo_logprobs_pending[delta.index] = False
        result = builder.build_prompt(self._prompt_of_choice[delta.index].token_ids, delta.prompt_logprobs)
        result.extend(builder.build(delta.token_ids, delta.logprobs))
        return result

    def _record_prompt_logprobs(self, delta: ChoiceDelta) -> None:
        """vLLM's prompt_logprobs field, once per choice (they come with its first tokens)."""
        if self._request.prompt_logprobs is None or not delta.token_ids or self._prompt_logprobs[delta.index]:
            return
        self._prompt_logprobs[delta.index] = vllm_prompt_logprobs(
            self._ctx.tokenizer, self._prompt_of_choice[delta.index].token_ids, delta.prompt_logprobs,
            self._request.prompt_logprobs)

    def _usage(self) -> UsageInfo:
        return UsageInfo(prompt_tokens=self._num_prompt_tokens, completion_tokens=self._num_completion_tokens,
                         total_tokens=self._num_prompt_tokens + self._num_completion_tokens)

    def _response(self, choices: list[CompletionChoice], usage: UsageInfo | None) -> CompletionResponse:
        return CompletionResponse(id=self._id, created=self._created,
                                  model=self._ctx.response_model(self._request.model), choices=choices, usage=usage)

    async def collect(self, deltas: AsyncGenerator[ChoiceDelta, None]) -> CompletionResponse:
        texts: list[list[str]] = [[] for _ in range(self._num_choices)]
        token_ids: list[list[int]] = [[] for _ in range(self._num_choices)]
        logprobs = [CompletionLogprobs() if b is not None else None for b in self._logprobs]
        endings: list[ChoiceDelta | None] = [None] * self._num_choices
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                self._num_completion_tokens += len(delta.token_ids)
                texts[delta.index].append(self._text(delta))
                token_ids[delta.index] += delta.token_ids
                part, whole = self._delta_logprobs(delta), logprobs[delta.index]
                if part is not None and whole is not None:
                    whole.extend(part)
                self._record_prompt_logprobs(delta)
                if delta.finish_reason:
                    endings[delta.index] = delta
        choices = [CompletionChoice(
            index=i, text="".join(texts[i]), logprobs=logprobs[i],
            finish_reason=endings[i].finish_reason if endings[i] else None,
            stop_reason=endings[i].stop_reason if endings[i] else None,
            prompt_logprobs=self._prompt_logprobs[i],
            prompt_token_ids=self._prompt_of_choice[i].token_ids if self._return_token_ids else None,
            token_ids=token_ids[i] if self._return_token_ids else None,
        ) for i in range(self._num_choices)]
        return self._response(choices, self._usage())

    async def stream(self, deltas: AsyncGenerator[ChoiceDelta, None]) -> AsyncIterator[str]:
        async with contextlib.aclosing(deltas):
            try:
                async for delta in deltas:
                    self._num_completion_tokens += len(delta.token_ids)
                    text = self._text(delta)
                    logprobs = self._delta_logprobs(delta)
                    shows_token_ids = self._return_token_ids and bool(delta.token_ids)
                    if not (text or delta.finish_reason or (logprobs and logprobs.tokens) or shows_token_ids):
                        continue  # a partial character or held-back text: nothing to show yet
                    yield sse_event(self._response([CompletionChoice(
                        index=delta.index, text=text, logprobs=logprobs,
                        finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                        prompt_token_ids=self._stream_prompt_token_ids(delta.index),
                        token_ids=list(delta.token_ids) if self._return_token_ids else None)],
                        self._usage() if self._request.continuous_usage else None))
                if self._request.include_usage:
                    yield sse_event(self._response([], self._usage()))
            except Exception as e:  # the status line is already sent: report in-band
                yield sse_event(as_openai_error(e).to_dict())
        yield DONE

