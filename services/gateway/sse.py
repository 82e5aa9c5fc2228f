"""Response bodies: server-sent events as OpenAI streams them (`data: {json}\\n\\n` ...,
`data: [DONE]\\n\\n`) and whole JSON responses."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    # no-cache / no buffering: proxies must pass each token through as it comes.
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def json_response(payload: BaseModel) -> Response:
    # pydantic's own encoder: faster than JSONResponse, and NaN/inf become null, not a 500.
    return Response(payload.model_dump_json(), media_type="application/json")
