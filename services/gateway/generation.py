"""Runs the engine requests behind one HTTP request and merges their outputs.

An OpenAI request becomes one engine request per choice (prompts x n). Each runs in
its own task, feeding a shared queue, so a slow choice never blocks another. Each choice
survives replica failures on its own (`migration.py`): its task keeps feeding the same
output processor whichever replica the tokens come from. Leaving the merged stream early,
for whatever reason (stop string, client gone, error), cancels those tasks, and the SDK
turns each cancellation into an abort so the scheduler frees the KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field

from starlette.requests import Request

from services.client.grpc_client import SchedulerUnavailable
from services.common.grpc_utils import cancelled_from_outside
from services.common.proto import myvllm_pb2 as pb
from services.common.sampling_params import SamplingParams, sampling_for_choice
from services.gateway.disaggregation import remote_prefill, wants_remote_prefill
from services.gateway.metrics import GatewayMetrics, RequestTimer
from services.gateway.migration import MigrationPolicy, ResumableRequest, resumable_outputs
from services.gateway.router import Replica, ReplicaRouter
from services.gateway.routing import RoutePrompt
from services.text.output_processor import ChoiceDelta, ChoiceOutputProcessor
from services.text.tokenizer import Tokenizer


@dataclass
class ChoiceRequest:
    """One choice: its engine request (resumable on another replica) and its text pipeline."""

    engine: ResumableRequest
    processor: ChoiceOutputProcessor
    # The samples of a prompt whose decode replica loads remote KV: the first is prefilled on a
    # prefill replica; the others start once it has its first output (the prompt's blocks are then
    # in that replica's prefix cache) instead of computing the prompt beside its load.
    first_of_prompt: bool = True
    prompt_started: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def request_id(self) -> str:
        return self.engine.request_id


@dataclass
class PromptSampling:
    """A prompt and the sampling settings for it (max_tokens may differ per prompt)."""

    token_ids: list[int]
    params: SamplingParams
    sampling: pb.SamplingParams


class _Done:
    """Queued by a choice task when it ends (with the error that ended it, if any)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


@dataclass
class _Run:
    """What every choice task of one HTTP request shares."""

    router: ReplicaRouter
    replica: Replica              # where the choices start
    metrics: GatewayMetrics
    migration: MigrationPolicy
    arrival_time: float
    route_prompt: RoutePrompt     # the prompt the replica was chosen for
    predicted_cached_tokens: int  # of route_prompt on `replica`, by its KV events at routing time
    sent_on: float                # the load report of `replica` the send was counted on (note_finished)


async def _run_choice(run: _Run, choice: ChoiceRequest, timer: RequestTimer,
                      deltas: asyncio.Queue[ChoiceDelta | _Done]) -> None:
    outputs = resumable_outputs(run.router, choice.engine, run.replica, run.migration,
                                on_migration=run.metrics.on_migration)
    # Prediction vs. outcome of cache-aware routing, for the engine requests of the routed prompt.
    check_prediction = choice.engine.prompt_token_ids is run.route_prompt.token_ids
    try:
        prompt = run.route_prompt if check_prediction else choice.engine.route_prompt()
        if wants_remote_prefill(choice.engine) and run.router.disaggregates(run.replica, prompt):
            if choice.first_of_prompt:  # (before the generator's first step, which reads the params)
                choice.engine.kv_transfer_params = await remote_prefill(run.router, choice.engine, run.metrics)
            else:
                await choice.prompt_started.wait()
        # aclosing: leaving this loop early (stop string) must abort the request *now*.
        async with contextlib.aclosing(outputs):
            async for output in outputs:
                choice.prompt_started.set()
                if output.num_prompt_tokens:
                    timer.on_prompt(output.num_prompt_tokens, output.num_cached_tokens)
                if output.new_token_ids:
                    timer.on_tokens(len(output.new_token_ids))
                if check_prediction and output.num_prompt_tokens:
                    check_prediction = False
                    if choice.engine.num_migrations == 0:
                        run.metrics.on_routed_prompt(run.predicted_cached_tokens, output.num_cached_tokens)
                delta = choice.processor.process(output)
                deltas.put_nowait(delta)
                if delta.finish_reason:
                    sampling = choice.engine.sampling
                    timer.on_finish(delta.finish_reason, output.timings if output.HasField("timings") else None,
                                    sampling.max_tokens if sampling.HasField("max_tokens") else None)
                    break
    except Exception as e:
        deltas.put_nowait(_Done(e))
        return
    except asyncio.CancelledError as e:
        if cancelled_from_outside():
            raise  # _merge_choices is closing the stream: nobody waits for this choice any more
        # Raised from below, not a cancellation of this task: the merged stream must still hear
        # that this choice ended, or it would wait for it forever.
        deltas.put_nowait(_Done(RuntimeError(f"choice {choice.request_id} was cancelled from below: {e!r}")))
        return
    finally:
        choice.prompt_started.set()  # (the other samples never wait for a choice that ended)
    deltas.put_nowait(_Done())


class DisconnectWatcher:
    """Calls `on_disconnect` if the HTTP client goes away before `stop()`.

    uvicorn keeps no task to cancel for us (a non-streaming handler just runs on),
    so we wait for the ASGI `http.disconnect` message ourselves. The request body has
    already been read by then, so `receive()` has nothing else left to deliver.
    """

    def __init__(self, request: Request | None, on_disconnect: Callable[[], Awaitable[None]]) -> None:
        self._request = request
        self._on_disconnect = on_disconnect
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._request is not None:
            self._task = asyncio.create_task(self._watch(), name="myvllm-disconnect-watcher")

    async def _watch(self) -> None:
        assert self._request is not None
        while (await self._request.receive())["type"] != "http.disconnect":
            pass
        await self._on_disconnect()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


def _by_prompt(choices: list[ChoiceRequest], timers: list[RequestTimer]) -> list[list[RequestTimer]]:
    """The timers of each prompt's n choices (vLLM counts n and the longest output per prompt)."""
    groups: dict[int, list[RequestTimer]] = {}
    for choice, timer in zip(choices, timers, strict=True):
        groups.setdefault(id(choice.engine.prompt_token_ids), []).append(timer)
    return list(groups.values())


async def _merge_choices(run: _Run, choices: list[ChoiceRequest]) -> AsyncGenerator[ChoiceDelta, None]:
    queue: asyncio.Queue[ChoiceDelta | _Done] = asyncio.Queue()
    timers = [run.metrics.timer(run.arrival_time) for _ in choices]
    prompts = _by_prompt(choices, timers)
    for group in prompts:
        run.metrics.on_prompt_choices(len(group))
    tasks = [asyncio.create_task(_run_choice(run, c, t, queue)) for c, t in zip(choices, timers, strict=True)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if isinstance(item, _Done):
                if item.error is not None:
                    raise item.error
                remaining -= 1
            else:
                yield item
        for group in prompts:
            run.metrics.on_prompt_done(max(timer.num_generated for timer in group))
    finally:
        # Cancelling a choice task aborts its engine request (no-op for finished ones).
        for task in tasks:
            task.cancel()
        run.router.note_finished(run.replica, run.sent_on)


async def start_routed(router: ReplicaRouter, choices: list[ChoiceRequest], metrics: GatewayMetrics,
                       http_request: Request | None, arrival_time: float | None = None,
                       migration: MigrationPolicy | None = None) -> AsyncGenerator[ChoiceDelta, None]:
    """Submit every choice to the replica the router picks (all together, so the n samples
    of a prompt share its cached blocks) and wait for the first delta, so that a refused
    request is still reported as an HTTP error status; return the merged stream of deltas
    (the first one included). Close the returned iterator (or run it to the end) to
    release everything; a client disconnect aborts all choices.

    A replica that is down before anything was submitted is marked so and the next one is
    tried (a prompt 503 when none answers); once submitted, a choice migrates instead."""
    arrival_time = time.monotonic() if arrival_time is None else arrival_time
    # The replica is chosen for the first prompt (a completions batch may carry several).
    prompt = choices[0].engine.route_prompt() if choices else RoutePrompt([])
    replica, sent_on = await connect_some_replica(router, prompt)
    run = _Run(router, replica, metrics, migration or MigrationPolicy(), arrival_time, prompt,
               router.cached_tokens(replica, prompt), sent_on)
    merged = _merge_choices(run, choices)

    async def abort_all() -> None:
        # The merged stream then ends with "abort" deltas and releases itself.
        for choice in choices:
            await choice.engine.abort()

    watcher = DisconnectWatcher(http_request, abort_all)
    watcher.start()
    try:
        first: ChoiceDelta | None = await anext(merged)
    except StopAsyncIteration:
        first = None
    except BaseException:
        watcher.stop()
        await merged.aclose()
        raise
    return _prepend(first, merged, watcher)


async def connect_some_replica(router: ReplicaRouter, prompt: RoutePrompt) -> tuple[Replica, float]:
    """The picked replica, once its stream is open (the next one while they turn out down), and
    the load report its send was counted on (`ReplicaRouter.note_finished`)."""
    tried: set[str] = set()
    while True:
        replica = router.pick(exclude=tried, prompt=prompt)
        sent_on = replica.load_ts
        try:
            await replica.client.connect()
            return replica, sent_on
        except SchedulerUnavailable as e:
            router.mark_down(replica, e)
            tried.add(replica.address)
            if tried >= set(router.replicas):
                raise


async def _prepend(first: ChoiceDelta | None, merged: AsyncGenerator[ChoiceDelta, None],
                   watcher: DisconnectWatcher) -> AsyncGenerator[ChoiceDelta, None]:
    try:
        if first is not None:
            yield first
        async for delta in merged:
            yield delta
    finally:
        watcher.stop()
        await merged.aclose()


@dataclass(frozen=True)
class RequestIds:
    """One HTTP request's ids: the response's `id` and the base of its engine request ids."""

    response: str
    engine: str


def request_ids(prefix: str, client_request_id: str | None) -> RequestIds:
    """vLLM's "{prefix}-{request_id}" ("chatcmpl", "cmpl"), with a fresh uuid when the client
    names none. A client's id reaches the engine requests too, with a suffix of its own: the
    scheduler needs each in-flight id unique, and clients reuse theirs (retries, fixed ids)."""
    if not client_request_id:
        generated = f"{prefix}-{uuid.uuid4().hex}"
        return RequestIds(generated, generated)
    response = f"{prefix}-{client_request_id}"
    return RequestIds(response, f"{response}-{uuid.uuid4().hex[:8]}")


def fan_out(request_id: str, prompts: list[PromptSampling], tokenizer: Tokenizer, priority: int = 0,
            cache_salt: str = "", lora_request: pb.LoRARequest | None = None) -> list[ChoiceRequest]:
    """One engine request per (prompt, sample): choice index = prompt_index * n + i and
    engine id `{request_id}-{index}`. The n samples of a prompt share its KV blocks
    through the scheduler's prefix cache; seeded samples get the offline `LLM`'s seeds."""
    choices = []
    for prompt_index, prompt in enumerate(prompts):
        n = prompt.params.n
        started = asyncio.Event()
        for sample in range(n):
            index = prompt_index * n + sample
            engine = ResumableRequest(request_id=f"{request_id}-{index}", prompt_token_ids=prompt.token_ids,
                                      sampling=sampling_for_choice(prompt.sampling, sample), priority=priority,
                                      cache_salt=cache_salt, lora_request=lora_request)
            choices.append(ChoiceRequest(engine, ChoiceOutputProcessor(index, tokenizer, prompt.token_ids,
                                                                       prompt.params),
                                         first_of_prompt=sample == 0, prompt_started=started))
    return choices
