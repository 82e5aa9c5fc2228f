"""Admission control: how many generation requests the gateway serves at once.

Up to `max_concurrent` requests run; up to `max_queued` more wait (first come, first
served) for one to finish; any beyond that are refused at once with 429 and a
`Retry-After`, so an overloaded gateway sheds load instead of piling up memory and
latency. While the gateway drains for shutdown, new requests get 503 and in-flight ones
(running or queued) finish. A slot is held until the response is completely sent, so a
long SSE stream counts for as long as it runs.
"""

from __future__ import annotations

import asyncio
from collections import deque
from http import HTTPStatus

from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.errors import RETRY_AFTER_S, OpenAIError, error_response

# Embeddings share the generation admission: one slot per HTTP request (its inputs are bounded by
# --max-choices-per-request), since they take the same engine's batch slots and KV blocks.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                              "/v1/embeddings"})


class AdmissionController:
    """Counts running and queued requests; hands out slots in arrival order."""

    def __init__(self, max_concurrent: int, max_queued: int) -> None:
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.num_running = 0
        self.num_rejected_queue_full = 0  # 429s: vLLM's admission_rejections, reason max_num_queued_reqs
        self._queue: deque[asyncio.Future[None]] = deque()
        self.draining = False

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_in_flight(self) -> int:
        return self.num_running + self.num_queued

    def start_draining(self) -> None:
        """Refuse new requests from now on (safe to call from a signal handler)."""
        self.draining = True

    async def acquire(self) -> None:
        """Wait for a slot; raises a 503 while draining and a 429 when the queue is full."""
        if self.draining:
            raise OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, "The server is shutting down",
                              type="service_unavailable_error", code="shutting_down")
        if self.num_running < self.max_concurrent and not self._queue:
            self.num_running += 1
            return
        if len(self._queue) >= self.max_queued:
            self.num_rejected_queue_full += 1
            raise OpenAIError(HTTPStatus.TOO_MANY_REQUESTS,
                              f"Too many requests: {self.num_running} running and {len(self._queue)} queued "
                              f"(--max-concurrent-requests {self.max_concurrent}, --max-queued-requests "
                              f"{self.max_queued}); retry later", type="rate_limit_error", code="too_many_requests",
                              retry_after_s=RETRY_AFTER_S)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(waiter)
        try:
            await waiter  # release() counts us as running before waking us
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # woken and cancelled at once: pass the slot on
            else:
                self._queue.remove(waiter)
            raise

    def release(self) -> None:
        while self._queue:
            waiter = self._queue.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to the next in line
                return
        self.num_running -= 1


class AdmissionMiddleware:
    """ASGI middleware applying an `AdmissionController` to the generation routes."""

    def __init__(self, app: ASGIApp, controller: AdmissionController) -> None:
        self.app = app
        self.controller = controller

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            await self.controller.acquire()
        except OpenAIError as e:
            await error_response(e, scope["path"])(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.controller.release()
