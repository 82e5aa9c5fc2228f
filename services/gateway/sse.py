"""Response bodies: server-sent events as OpenAI streams them (`data: {json}\\n\\n` ...,
`data: [DONE]\\n\\n`) and whole JSON responses.

Every streamed response goes through `sse_response`, whose guard is the last line of defence
for the invariant that a stream ends in-band: an exception that gets past a writer's own error
handling would otherwise reach uvicorn, which can only drop the connection (the client sees a
connection error, not what went wrong). The guard logs it and ends the stream with the API's
error event instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from services.common.grpc_utils import cancelled_from_outside
from services.gateway.errors import as_openai_error

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


def openai_error_events(error: Exception) -> list[str]:
    """How an OpenAI stream (chat, completions) ends on an error: an error event, then [DONE]."""
    return [sse_event(as_openai_error(error).to_dict()), DONE]


async def guarded_events(events: AsyncIterator[str],
                         on_error: Callable[[Exception], Iterable[str]] = openai_error_events) -> AsyncIterator[str]:
    """`events`, ended by `on_error`'s events (logged here) if it raises, unless it already sent
    [DONE]. A cancellation of this task itself still propagates."""
    finished = False
    try:
        async with contextlib.aclosing(events):  # (closing it early closes the writer and its requests)
            async for event in events:
                yield event
                finished = event == DONE
    except (Exception, asyncio.CancelledError) as e:
        if isinstance(e, asyncio.CancelledError):
            if cancelled_from_outside():
                raise
            e = RuntimeError(f"the response stream was cancelled from below: {e!r}")
        logger.error("a response stream failed outside its own error handling; ending it with an error event",
                     exc_info=e)
        if not finished:
            for event in on_error(e):
                yield event


def sse_response(events: AsyncIterator[str],
                 on_error: Callable[[Exception], Iterable[str]] = openai_error_events) -> StreamingResponse:
    """`events` as a streamed response (guarded: see the module docstring); `on_error`: the
    events that end this API's stream on an error (default: OpenAI's error event and [DONE])."""
    # no-cache / no buffering: proxies must pass each token through as it comes.
    return StreamingResponse(guarded_events(events, on_error), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def json_response(payload: BaseModel) -> Response:
    # pydantic's own encoder: faster than JSONResponse, and NaN/inf become null, not a 500.
    return Response(payload.model_dump_json(), media_type="application/json")
