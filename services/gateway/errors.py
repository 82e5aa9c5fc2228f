"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

Every failure the gateway reports, including FastAPI's own validation errors (422 by
default) and unknown routes, goes out in this shape so OpenAI clients can parse it; on the
Anthropic Messages routes (/v1/messages...) the same error, same status, goes out in
Anthropic's shape (`error_body` is the one place that picks).

Engine failures reach the client as a short message of ours (`as_openai_error`, the one place
that maps them): what the scheduler client says about a failure names internal addresses and
gRPC status text, which are logged here and never sent. A 503 or 429 the client may simply
retry carries `Retry-After`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.client.grpc_client import RequestRejected, SchedulerUnavailable
from services.common.param_errors import SamplingParamsError
from services.common.proto import myvllm_pb2 as pb
from services.gateway.migration import MigrationFailed

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a retryable 503 or 429 tells the client to wait (Retry-After, seconds)


class OpenAIError(Exception):
    """An error to send to the client with an HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",  # noqa: A002 (OpenAI's field name)
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s  # sent as Retry-After (error_response)

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 invalid_request_error."""
    return OpenAIError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


def unsupported(feature: str, param: str | None = None) -> OpenAIError:
    """A 400 for an OpenAI feature this server does not implement."""
    return invalid_request(f"{feature} is not supported", param=param or feature, code="unsupported_parameter")


def unrecognized_fields(names: Sequence[str]) -> OpenAIError:
    """OpenAI's 400 for request fields it does not know (`names`: their parameter paths)."""
    return invalid_request(f"Unrecognized request argument supplied: {', '.join(names)}", param=names[0])


def unavailable(message: str, code: str) -> OpenAIError:
    """A 503 the client may retry after `RETRY_AFTER_S`; `message` must name no internal detail."""
    return OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, message, type="service_unavailable_error", code=code,
                       retry_after_s=RETRY_AFTER_S)


def scheduler_unavailable(error: Exception) -> OpenAIError:
    """No engine replica answered (`error` is logged: it names the replica's address)."""
    logger.warning("engine unavailable for a request: %s", error)
    return unavailable("The engine is unavailable; retry later", "scheduler_unavailable")


def engine_error(error: RequestRejected) -> OpenAIError:
    """What the engine said about a request: 400 only when it was the client's mistake (the
    engine's own words, about the request); a request the engine failed is ours (500), one no
    replica could take is a 503, both with our own message (the engine's is logged)."""
    if error.error_kind == pb.INVALID_REQUEST:
        return invalid_request(error.message, code="rejected_by_engine")
    if error.error_kind == pb.RESOURCE_EXHAUSTED:  # backpressure: the client retries later, we don't pile on
        return OpenAIError(HTTPStatus.TOO_MANY_REQUESTS, f"The engine is overloaded: {error.message}",
                           type="rate_limit_error", code="engine_queue_full", retry_after_s=RETRY_AFTER_S)
    logger.warning("the engine failed request %s (error kind %d): %s", error.request_id, error.error_kind,
                   error.message)
    if error.error_kind == pb.UNAVAILABLE:
        return unavailable("The engine cannot take the request now; retry later", "engine_unavailable")
    return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, "The engine failed the request", type="server_error",
                       code="engine_fault")


def migration_failed(error: MigrationFailed) -> OpenAIError:
    """The request's replica failed and it could not be resumed: its message says how (no
    address); the failure that ended it is logged."""
    logger.warning("%s; last failure: %s", error, error.__cause__)
    return unavailable(str(error), "migration_failed")


def as_openai_error(error: Exception) -> OpenAIError:
    """Map any exception raised while serving a request to the error to report."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, SamplingParamsError):
        return invalid_request(str(error), param=error.param)
    if isinstance(error, SchedulerUnavailable):
        return scheduler_unavailable(error)
    if isinstance(error, RequestRejected):
        return engine_error(error)
    if isinstance(error, MigrationFailed):
        return migration_failed(error)
    logger.exception("unexpected error while serving a request", exc_info=error)
    return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, f"Internal server error: {type(error).__name__}",
                       type="server_error")


# Anthropic's error types by HTTP status (its clients pick their exception class by status;
# the type tells humans and logs what went wrong). Other 4xx: invalid_request_error, 5xx: api_error.
_ANTHROPIC_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "overloaded_error",
}
ANTHROPIC_PATH = "/v1/messages"


def anthropic_error_body(error: OpenAIError) -> dict[str, Any]:
    """`error` in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`."""
    kind = _ANTHROPIC_ERROR_TYPES.get(error.status_code,
                                      "api_error" if error.status_code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_body(error: OpenAIError, path: str | None = None) -> dict[str, Any]:
    """The body for `error` on a request to `path`: Anthropic's shape on the Messages API
    routes (its clients cannot parse OpenAI's), OpenAI's everywhere else."""
    if path is not None and (path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")):
        return anthropic_error_body(error)
    return error.to_dict()


def error_response(error: OpenAIError, path: str | None = None) -> JSONResponse:
    """`error` as the response to a request to `path` (with its Retry-After, if any)."""
    headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s is not None else None
    return JSONResponse(error_body(error, path), status_code=error.status_code, headers=headers)


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none", "null"}


def _is_union_member_tag(part: int | str) -> bool:
    # pydantic puts the union member it tried into the location: ("stop", "list[str]").
    return isinstance(part, str) and ("[" in part or part in _TYPE_NAMES or part.startswith("function-"))


def _param_from_location(location: Sequence[int | str]) -> str | None:
    """("body", "messages", 0, "role") -> "messages[0].role"."""
    parts = list(location[1:] if location and location[0] == "body" else location)
    text = ""
    for part in parts:
        if _is_union_member_tag(part):
            continue
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or None


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """FastAPI/pydantic validation failure -> 400 naming the first bad field."""
    errors = exc.errors()
    if not errors:
        return invalid_request("Invalid request body")
    first = errors[0]
    unknown = [_param_from_location(e.get("loc", ())) or repr(e.get("loc", ("",))[-1])
               for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:  # OpenAI's answer to a field it does not know
        return unrecognized_fields(unknown)
    if first.get("type") == "json_invalid":
        return invalid_request(f"Invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}")
    param = _param_from_location(first.get("loc", ()))
    if param is None:
        return invalid_request(f"Invalid request body: {first.get('msg')}")
    message = f"{param}: {first.get('msg')}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return invalid_request(message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error path of `app` through the OpenAI error shape."""

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc), request.scope["path"])

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = HTTPStatus(exc.status_code)
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "not_found" if exc.status_code == 404 else None
        error = OpenAIError(exc.status_code, str(exc.detail or status.phrase), type=error_type, code=code)
        return error_response(error, request.scope["path"])

    async def _on_known_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(as_openai_error(exc), request.scope["path"])

    for known in (OpenAIError, SamplingParamsError, SchedulerUnavailable, RequestRejected, MigrationFailed):
        app.add_exception_handler(known, _on_known_error)
    # Anything else is a bug: Starlette's ServerErrorMiddleware sends this and logs it.
    app.add_exception_handler(Exception, _on_known_error)
