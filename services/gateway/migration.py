"""Request migration: an engine request that outlives the replica it started on.

The gateway holds every token id a request has produced so far (docs/design.md: what was
streamed to the client is gateway state). When the replica's stream breaks, its scheduler
dies, or the scheduler reports that the engine failed the request (ENGINE_FAULT,
UNAVAILABLE, or an error without a kind from an older peer), the request is submitted
again, to another replica or to the same one once it answers again, with those tokens as
`resumed_output_token_ids`: the scheduler recomputes prompt + resumed tokens like a
preempted request and streams back only what comes after them. The text pipeline above
(detokenizer, stop strings) just keeps receiving token ids, so the client sees one stream.

A rejection that is the client's own fault (INVALID_REQUEST) is never retried, nor is a full
waiting queue (RESOURCE_EXHAUSTED: the client gets a 429 and backs off). Migration
is bounded by `MigrationPolicy`: at most `max_migrations` re-submissions per request and at
most `wait_s` seconds waiting for a replica to answer; then `MigrationFailed` says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from services.client.grpc_client import AsyncClient, RequestRejected, SchedulerUnavailable
from services.common.block_hash import adapter_key
from services.common.grpc_utils import cancelled_from_outside
from services.common.proto import myvllm_pb2 as pb
from services.gateway.router import Replica, ReplicaRouter
from services.gateway.routing import RoutePrompt

logger = logging.getLogger(__name__)

DEFAULT_MAX_MIGRATIONS = 3
DEFAULT_MIGRATION_WAIT_S = 120.0


@dataclass(frozen=True)
class MigrationPolicy:
    """How hard the gateway tries to keep a request alive across replica failures."""

    max_migrations: int = DEFAULT_MAX_MIGRATIONS  # re-submissions per engine request (0 = never migrate)
    wait_s: float = DEFAULT_MIGRATION_WAIT_S      # longest wait for some replica to answer again
    poll_interval_s: float = 0.25                 # first pause between rounds of health checks while waiting
    max_poll_interval_s: float = 2.0              # the pause doubles up to this


class MigrationFailed(RuntimeError):
    """A request lost its replica and could not be resumed (the message, which the client gets,
    says how and names no address; the failure that ended it is the exception's cause)."""


def is_engine_failure(error: BaseException) -> bool:
    """Whether `error` means the engine, not the client, failed the request (so it may migrate)."""
    if isinstance(error, SchedulerUnavailable):
        return True
    return isinstance(error, RequestRejected) and error.is_engine_failure


@dataclass
class ResumableRequest:
    """One engine request as the gateway tracks it across replicas."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: pb.SamplingParams
    priority: int = 0
    cache_salt: str = ""
    output_token_ids: list[int] = field(default_factory=list)  # every token received, over all replicas
    num_migrations: int = 0
    # The LoRA adapter it runs with (None: the base model), on every replica it runs on.
    lora_request: pb.LoRARequest | None = None
    # Its prompt's KV on a prefill replica (services/gateway/disaggregation.py): for the first
    # attempt, on a replica that loads remote KV (a migrated request computes what it needs).
    kv_transfer_params: pb.KVTransferParams | None = None
    # Where the request runs now: the replica's client and the engine request id there.
    _current: tuple[AsyncClient, str] | None = field(default=None, repr=False)

    def route_prompt(self) -> RoutePrompt:
        """What cache-aware routing hashes: the prompt, keyed by its salt and adapter."""
        lora = self.lora_request
        return RoutePrompt(self.prompt_token_ids, self.cache_salt,
                           adapter_key(lora.lora_name, lora.lora_int_id) if lora is not None else "")
    _aborted: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def attempt_id(self) -> str:
        """The engine request id of the current attempt: a fresh id per migration, so a
        replica that still holds the old attempt (its abort in flight) never sees a duplicate."""
        return self.request_id if self.num_migrations == 0 else f"{self.request_id}-m{self.num_migrations}"

    def resume_sampling(self) -> pb.SamplingParams:
        """The settings to submit with: prompt logprobs came with the first tokens already,
        and asking again would needlessly bypass the prefix cache on the recompute."""
        if not (self.output_token_ids and self.sampling.HasField("prompt_logprobs")):
            return self.sampling
        resumed = pb.SamplingParams()
        resumed.CopyFrom(self.sampling)
        resumed.ClearField("prompt_logprobs")
        return resumed

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    async def abort(self) -> None:
        """The client went away: abort the current attempt (its output stream then ends with
        "abort") and never migrate again."""
        self._aborted.set()
        if self._current is not None:
            client, attempt_id = self._current
            await client.abort([attempt_id])


async def resumable_outputs(router: ReplicaRouter, request: ResumableRequest, replica: Replica,
                            policy: MigrationPolicy, on_migration: Callable[[], None] = lambda: None,
                            ) -> AsyncGenerator[pb.RequestOutput, None]:
    """Yield the request's outputs, starting on `replica`, migrating on engine failures.

    Raises the client's own rejection (`RequestRejected` with INVALID_REQUEST) as is, and
    `MigrationFailed` once the policy's bounds are spent. Closing the generator aborts
    the current attempt."""
    failed_on: set[str] = set()
    deadline: float | None = None
    if request.aborted:  # (while its prefill half ran on a prefill replica)
        yield pb.RequestOutput(request_id=request.attempt_id, finish_reason="abort", stop_token_id=-1)
        return
    while True:
        request._current = (replica.client, request.attempt_id)
        outputs = replica.client.generate(
            request.prompt_token_ids, request.resume_sampling(), request_id=request.attempt_id,
            priority=request.priority, cache_salt=request.cache_salt,
            resumed_output_token_ids=request.output_token_ids, dp_wave=router.dp_wave_for(replica),
            kv_transfer_params=request.kv_transfer_params
            if request.num_migrations == 0 and replica.loads_remote_kv else None,
            lora_request=request.lora_request)
        try:
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    request.output_token_ids.extend(output.new_token_ids)
                    deadline = None  # progress: a later failure gets a fresh wait
                    yield output
                    if output.finish_reason:
                        return
            return
        except (SchedulerUnavailable, RequestRejected) as e:
            if not is_engine_failure(e):
                raise
            failure: Exception = e
        except asyncio.CancelledError as e:
            if cancelled_from_outside():
                raise
            # From below, not a cancellation of this request: gRPC cancels a call whose channel
            # is closed under it. The attempt is lost like one whose stream broke.
            failure = SchedulerUnavailable(f"request {request.attempt_id} lost: its call was cancelled ({e!r})")
        finally:
            request._current = None
        if request.aborted:
            yield pb.RequestOutput(request_id=request.attempt_id, finish_reason="abort", stop_token_id=-1)
            return
        if isinstance(failure, SchedulerUnavailable):
            router.mark_down(replica, failure)
        failed_on.add(replica.address)
        if request.num_migrations >= policy.max_migrations:
            if policy.max_migrations == 0:
                raise failure  # migration is off: report the engine's own error
            raise MigrationFailed(  # (goes to the client: no address; errors.py logs the failure)
                f"request {request.request_id} failed {request.num_migrations + 1} times on {len(failed_on)} "
                f"engine replica(s) (--max-migrations {policy.max_migrations})") from failure
        if deadline is None:
            deadline = time.monotonic() + policy.wait_s
        replica = await _find_replica(router, request, failed_on, deadline, policy, failure)
        if replica is None:  # aborted while waiting
            yield pb.RequestOutput(request_id=request.attempt_id, finish_reason="abort", stop_token_id=-1)
            return
        request.num_migrations += 1
        on_migration()
        logger.info("migrating request %s to %s with %d generated tokens (migration %d): %s",
                    request.request_id, replica.address, len(request.output_token_ids), request.num_migrations,
                    failure)


async def group_ready(router: ReplicaRouter, replica: Replica) -> bool:
    """Whether every other engine of `replica`'s data-parallel expert-parallel group answers ready.
    Such an engine steps only together with its group: while a sibling has lost its worker (and
    before it noticed, the group is about to stop) or is still starting after the group's restart,
    a request sent there would fail again and spend a migration, or wait on its group."""
    if replica.dp_group is None:
        return True
    siblings = [r for r in router.replicas.values() if r.dp_group == replica.dp_group and r is not replica]
    answers = await asyncio.gather(*(r.client.health() for r in siblings), return_exceptions=True)
    return all(answer is True for answer in answers)


async def _find_replica(router: ReplicaRouter, request: ResumableRequest, failed_on: set[str], deadline: float,
                        policy: MigrationPolicy, failure: Exception) -> Replica | None:
    """A replica that is ready: its scheduler answers and says so in Health (one whose worker
    is gone, or which is still setting its worker up again, says not ready), and so does the rest
    of its expert-parallel group if it is in one. One that has not failed this request first, else
    one that did: in the default one-replica deployment the request waits, polling with backoff,
    for its own replica to come back. None if the request is aborted meanwhile."""
    pause = policy.poll_interval_s
    while not request.aborted:
        for replica in router.ranked(avoid=failed_on):
            try:
                await replica.client.connect()
            except SchedulerUnavailable as e:
                router.mark_down(replica, e)
                continue
            if not await replica.client.health():
                continue  # alive, not serving yet (worker restarting): try it again next round
            if not await group_ready(router, replica):
                continue
            router.mark_up(replica)
            router.note_sent(replica)
            return replica
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise MigrationFailed(
                f"request {request.request_id} lost its engine replica and no replica was ready "
                f"within --migration-wait {policy.wait_s:g}s") from failure
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(request._aborted.wait(), min(pause, remaining))
        pause = min(pause * 2, policy.max_poll_interval_s)
    return None
