"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response
from starlette.requests import Request

from services.common.proto import myvllm_pb2 as pb
from services.common.sampling_params import MAX_LOGPROBS, SamplingParams
from services.common.structured_outputs import StructuredOutputsParams
from services.gateway.context import GatewayContext
from services.gateway.errors import as_openai_error, invalid_request, unsupported
from services.gateway.generation import PromptSampling, fan_out, request_ids, start_routed
from services.gateway.logprobs import chat_logprobs, vllm_prompt_logprobs
from services.gateway.prompts import EnginePrompt, chat_prompt, message_text, prompt_truncation
from services.gateway.protocol import (
    AssistantMessage,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatLogprobToken,
    DeltaMessage,
    UsageInfo,
)
from services.gateway.sampling import build_sampling_params, check_context_length, check_prompt_logprobs_not_streamed
from services.gateway.sse import DONE, json_response, sse_event, sse_response
from services.gateway.structured_outputs import request_structured_outputs
from services.gateway.tool_parsers import StreamPiece, ToolCallParser
from services.gateway.tools import ToolPlan, ToolSettings, plan_tools
from services.text.output_processor import ChoiceDelta


def _num_top_logprobs(request: ChatCompletionRequest) -> int | None:
    """Engine logprobs setting: None = off, k = sampled token plus top k."""
    top = request.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise invalid_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {top}", param="top_logprobs")
    if not request.logprobs:
        if top:
            raise invalid_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        return None
    return top or 0


async def create_chat_completion(ctx: GatewayContext, request: ChatCompletionRequest,
                                 http_request: Request | None = None) -> Response:
    arrival_time = time.monotonic()
    chat = await prepare_chat(ctx, request)
    ids = request_ids("chatcmpl", request.request_id)
    deltas = await start_chat(ctx, request, chat, ids.engine, http_request, arrival_time)
    writer = _ChatWriter(ctx, request, ids.response, chat.prompt, chat.num_top, chat.tools)
    if request.stream:
        return sse_response(writer.stream(deltas, chat.params.n))
    return json_response(await writer.collect(deltas, chat.params.n))


@dataclass
class PreparedChat:
    """A chat request ready for the engine (what `prepare_chat` made of it)."""

    prompt: EnginePrompt
    params: SamplingParams
    sampling: pb.SamplingParams
    tools: ToolPlan | None
    num_top: int | None  # the engine's logprobs setting (None: off)


async def prepare_chat(ctx: GatewayContext, request: ChatCompletionRequest) -> PreparedChat:
    """Everything a chat request needs before the engine: its checks (a 400 / 404 naming what
    is wrong), its tool plan and output constraint, the chat template and the sampling params.
    Shared by the OpenAI and Anthropic routes, so both render and sample alike."""
    ctx.check_model(request.model)
    if (field := request.unsupported_field()) is not None:
        raise unsupported(field)
    num_top = _num_top_logprobs(request)
    check_prompt_logprobs_not_streamed(request)
    _check_limits(ctx, request)
    ctx.limits.check_stop(request.stop)
    # Parsing a schema can take a while (xgrammar): off the event loop.
    tools, structured_outputs = await asyncio.to_thread(_constraints, request, ctx.tools)
    max_model_len = await ctx.max_model_len()
    # The chat template, tokenizing and the bad words' tokens: in the tokenizer pool.
    prompt, (params, sampling) = await ctx.in_tokenizer_pool(
        _prompt_and_sampling, ctx, request, tools, structured_outputs, num_top, max_model_len)
    return PreparedChat(prompt, params, sampling, tools, num_top)


async def render_chat_request(ctx: GatewayContext, request: ChatCompletionRequest) -> EnginePrompt:
    """The prompt a chat request would run with (its tools shown as they would be), without
    running it: what token counting reports."""
    ctx.check_model(request.model)
    _check_limits(ctx, request)
    tools = await asyncio.to_thread(plan_tools, request, ctx.tools)
    max_model_len = await ctx.max_model_len()
    return await ctx.in_tokenizer_pool(_render_prompt, ctx, request, tools, max_model_len)


async def start_chat(ctx: GatewayContext, request: ChatCompletionRequest, chat: PreparedChat, request_id: str,
                     http_request: Request | None, arrival_time: float) -> AsyncGenerator[ChoiceDelta, None]:
    """Submit a prepared chat request's choices to a replica; its merged stream of deltas."""
    prompts = [PromptSampling(chat.prompt.token_ids, chat.params, chat.sampling)]
    ctx.log_request(request_id, prompts)
    choices = fan_out(request_id, prompts, ctx.tokenizer, request.priority, request.cache_salt or "",
                      ctx.check_model(request.model))
    return await start_routed(ctx.router, choices, ctx.metrics, http_request, arrival_time, ctx.migration)


def _check_limits(ctx: GatewayContext, request: ChatCompletionRequest) -> None:
    ctx.limits.check_messages(request.messages)
    ctx.limits.check_tools(request.tools)


def _template_kwargs(request: ChatCompletionRequest) -> dict[str, Any] | None:
    """chat_template_kwargs plus what vLLM adds from the request: its reasoning_effort (over the
    kwargs' own), and enable_thinking unless the kwargs set it (off only for effort "none";
    templates that read neither ignore them)."""
    kwargs = dict(request.chat_template_kwargs or {})
    if request.reasoning_effort is not None:
        kwargs["reasoning_effort"] = request.reasoning_effort
        kwargs.setdefault("enable_thinking", request.reasoning_effort != "none")
    return kwargs or None


def _render_prompt(ctx: GatewayContext, request: ChatCompletionRequest, tools: ToolPlan | None,
                   max_model_len: int) -> EnginePrompt:
    return chat_prompt(ctx.tokenizer, request.messages, request.add_generation_prompt,
                       request.continue_final_message, _template_kwargs(request),
                       tools.tools if tools is not None else None, bound=ctx.prompt_bound(max_model_len),
                       documents=request.documents, add_special_tokens=request.add_special_tokens,
                       truncation=prompt_truncation(request.truncate_prompt_tokens, request.truncation_side,
                                                    max_model_len))


def _prompt_and_sampling(ctx: GatewayContext, request: ChatCompletionRequest, tools: ToolPlan | None,
                         structured_outputs: StructuredOutputsParams | None, num_top: int | None,
                         max_model_len: int) -> tuple[EnginePrompt, tuple[SamplingParams, pb.SamplingParams]]:
    prompt = _render_prompt(ctx, request, tools, max_model_len)
    requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    check_context_length(requested, len(prompt.token_ids), max_model_len, "messages")
    return prompt, build_sampling_params(request, ctx.tokenizer, requested, num_top,
                                         structured_outputs=structured_outputs,
                                         skip_special_tokens=tools.skip_special_tokens if tools else None,
                                         defaults=ctx.request_defaults)


def _constraints(request: ChatCompletionRequest,
                 settings: ToolSettings) -> tuple[ToolPlan | None, StructuredOutputsParams | None]:
    """The request's tool plan and output constraint (its tools' or its response_format's)."""
    tools = plan_tools(request, settings)
    structured_outputs = request_structured_outputs(request)
    if tools is not None and tools.structured_outputs is not None:
        if structured_outputs is not None:
            raise invalid_request("response_format / structured_outputs cannot be combined with tool_choice "
                                  "'required' or a named function (those constrain the output to the tools)",
                                  param="tool_choice")
        structured_outputs = tools.structured_outputs
    return tools, structured_outputs


def stream_piece(parser: ToolCallParser | None, delta: ChoiceDelta) -> StreamPiece:
    """What one delta of a choice shows: its text, or what its tool-call parser (if any) makes
    of it, held-back text included once the choice has finished."""
    if parser is None:
        return StreamPiece(content=delta.text)
    piece = parser.feed(delta.text)
    if delta.finish_reason:
        rest = parser.finish()
        piece = StreamPiece(piece.content + rest.content, piece.tool_calls + rest.tool_calls)
    return piece


def _echo_text(request: ChatCompletionRequest) -> str:
    """vLLM's echo on chat: the last message's content, shown before the reply when the reply
    continues that message's role (no generation prompt, or an assistant message last)."""
    last = request.messages[-1]
    role = "assistant" if request.add_generation_prompt else last.role
    return message_text(last) if last.role == role else ""


class _ChatWriter:
    """Shapes one chat completion's deltas as OpenAI responses or chunks."""

    def __init__(self, ctx: GatewayContext, request: ChatCompletionRequest, request_id: str,
                 prompt: EnginePrompt, num_top: int | None, tools: ToolPlan | None = None) -> None:
        self._ctx = ctx
        self._tools = tools
        # One tool-call parser per choice, made on first use (None: no tool calling).
        self._parsers: dict[int, ToolCallParser] = {}
        self._request = request
        self._id = request_id
        self._created = int(time.time())
        self._prompt = prompt
        self._prompt_token_ids = prompt.token_ids
        self._num_prompt_tokens = len(prompt.token_ids)
        self._num_top = num_top
        self._num_completion_tokens = 0
        self._echo = _echo_text(request) if request.echo else ""
        self._return_token_ids = bool(request.return_token_ids)
        self._role = ctx.request_defaults.role(request.add_generation_prompt)  # (--response-role)

    def _logprobs(self, delta: ChoiceDelta) -> list[ChatLogprobToken] | None:
        if self._num_top is None:
            return None
        return chat_logprobs(self._ctx.tokenizer, delta.token_ids, delta.logprobs, self._num_top,
                             as_token_ids=bool(self._request.return_tokens_as_token_ids))

    def _parser(self, index: int) -> ToolCallParser | None:
        if self._tools is None or self._tools.new_parser is None:
            return None
        if index not in self._parsers:
            self._parsers[index] = self._tools.new_parser()
        return self._parsers[index]

    def _finish_reason(self, finish_reason: str | None, called: bool) -> str | None:
        """A choice that ended normally with tool calls reports the plan's reason ("tool_calls")."""
        if called and finish_reason == "stop":
            return self._tools.finish_reason
        return finish_reason

    def _message(self, index: int, text: str) -> AssistantMessage:
        parser = self._parser(index)
        if parser is None:
            return AssistantMessage(role=self._role, content=text)
        extracted = parser.extract(text)
        return AssistantMessage(role=self._role, content=extracted.content, tool_calls=extracted.tool_calls)

    def _stream_piece(self, delta: ChoiceDelta) -> StreamPiece:
        return stream_piece(self._parser(delta.index), delta)

    def _usage(self) -> UsageInfo:
        return UsageInfo(prompt_tokens=self._num_prompt_tokens, completion_tokens=self._num_completion_tokens,
                         total_tokens=self._num_prompt_tokens + self._num_completion_tokens)

    def _chunk(self, choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None,
               first: bool = False) -> str:
        """One chunk; the `first` ones (each choice's role) carry the prompt's vLLM fields, if asked for."""
        if usage is None and self._request.continuous_usage:
            usage = self._usage()
        return sse_event(ChatCompletionChunk(
            id=self._id, created=self._created, model=self._ctx.response_model(self._request.model), choices=choices,
            usage=usage,
            prompt_token_ids=self._prompt_token_ids if first and self._return_token_ids else None,
            prompt_text=self._prompt.text if first and self._request.return_prompt_text else None))

    def _with_echo(self, message: AssistantMessage) -> AssistantMessage:
        if self._echo:
            message.content = self._echo + (message.content or "")
        return message

    async def collect(self, deltas: AsyncGenerator[ChoiceDelta, None], n: int) -> ChatCompletionResponse:
        texts: list[list[str]] = [[] for _ in range(n)]
        token_ids: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[ChatLogprobToken]] = [[] for _ in range(n)]
        endings: list[ChoiceDelta | None] = [None] * n
        prompt_logprobs = None
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                self._num_completion_tokens += len(delta.token_ids)
                texts[delta.index].append(delta.text)
                token_ids[delta.index] += delta.token_ids
                if self._request.prompt_logprobs is not None and prompt_logprobs is None and delta.token_ids:
                    prompt_logprobs = vllm_prompt_logprobs(self._ctx.tokenizer, self._prompt_token_ids,
                                                           delta.prompt_logprobs, self._request.prompt_logprobs)
                logprobs[delta.index] += self._logprobs(delta) or []
                if delta.finish_reason:
                    endings[delta.index] = delta
        messages = [self._message(i, "".join(texts[i])) for i in range(n)]
        choices = [ChatCompletionChoice(
            index=i,
            message=self._with_echo(messages[i]),
            logprobs=ChatChoiceLogprobs(content=logprobs[i]) if self._num_top is not None else None,
            finish_reason=self._finish_reason(endings[i].finish_reason if endings[i] else None,
                                              bool(messages[i].tool_calls)),
            stop_reason=endings[i].stop_reason if endings[i] else None,
            token_ids=token_ids[i] if self._return_token_ids else None,
        ) for i in range(n)]
        return ChatCompletionResponse(
            id=self._id, created=self._created, model=self._ctx.response_model(self._request.model), choices=choices,
            usage=self._usage(), prompt_logprobs=prompt_logprobs,
            prompt_token_ids=self._prompt_token_ids if self._return_token_ids else None,
            prompt_text=self._prompt.text if self._request.return_prompt_text else None)

    async def stream(self, deltas: AsyncGenerator[ChoiceDelta, None], n: int) -> AsyncIterator[str]:
        async with contextlib.aclosing(deltas):
            try:
                for i in range(n):
                    yield self._chunk([ChatCompletionStreamChoice(
                        index=i, delta=DeltaMessage(role=self._role, content=""))], first=True)
                for i in range(n if self._echo else 0):
                    yield self._chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=self._echo))])
                async for delta in deltas:
                    self._num_completion_tokens += len(delta.token_ids)
                    logprobs = self._logprobs(delta)
                    piece = self._stream_piece(delta)
                    shows_token_ids = self._return_token_ids and bool(delta.token_ids)
                    if not (piece.content or piece.tool_calls or delta.finish_reason or logprobs or shows_token_ids):
                        continue  # a partial character or held-back text: nothing to show yet
                    parser = self._parser(delta.index)
                    yield self._chunk([ChatCompletionStreamChoice(
                        index=delta.index,
                        delta=DeltaMessage(content=piece.content or None, tool_calls=piece.tool_calls or None),
                        logprobs=ChatChoiceLogprobs(content=logprobs) if logprobs is not None else None,
                        finish_reason=self._finish_reason(delta.finish_reason,
                                                          parser is not None and parser.num_calls > 0),
                        stop_reason=delta.stop_reason,
                        token_ids=list(delta.token_ids) if self._return_token_ids else None,
                    )])
                if self._request.include_usage:
                    yield self._chunk([], usage=self._usage())
            except Exception as e:  # the status line is already sent: report in-band, as OpenAI does
                yield sse_event(as_openai_error(e).to_dict())
        yield DONE
