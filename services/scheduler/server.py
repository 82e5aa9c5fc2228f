"""The scheduler service: proto `Scheduler` over grpc.aio, driving its workers' Execute stream.

One asyncio task runs the engine's step loop (services/engine/step_loop.py: schedule → send the
batch to the workers → read the sampled ids → fold them in → route outputs) over the workers'
gRPC streams (worker_group.py). Gateway streams only put requests in and take outputs from
unbounded per-stream queues, so a slow gateway never stalls the loop.

When the worker fails (dies, hangs past --engine-timeout, or fails a step) every live
request ends with error_kind=ENGINE_FAULT (gateways migrate them), the prefix cache is
dropped, the replica reports itself unhealthy and leaves Redis, and the loop keeps trying
to set the worker up again (LoadModel, KV capacity, InitKVCache). Requests that arrive
meanwhile end at once with error_kind=UNAVAILABLE.

An engine of a data-parallel expert-parallel group (--data-parallel-size D with
--enable-expert-parallel) steps in lockstep with the others while the group's wave runs
(dp_wave.py); its ranks share a process group with every other engine's, whose rendezvous DP
rank 0's scheduler hosts at --data-parallel-address HOST:PORT. A failed worker breaks that
group for all, so such an engine cannot set its worker up again alone: it fails its requests
(gateways migrate them) and exits with the reason; `serve` restarts the whole group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

import grpc

from services.common import grpc_utils
from services.common.auth import server_interceptors
from services.common.config import DEFAULT_MAX_WAITING_REQUESTS, VllmConfig
from services.common.dp_wave import check_request_wave
from services.common.grpc_utils import StartupError
from services.common.message_limits import generate_request_bytes, receive_limit, runner_output_bytes
from services.common.proto import myvllm_pb2 as pb
from services.common.proto import myvllm_pb2_grpc as pb_grpc
from services.common.redis_registry import KV_ADDRESS_FIELD, is_group_name
from services.engine.engine_core import EngineCore
from services.engine.kv_tier import KVTierScheduler
from services.engine.spec_decode import drafts_per_step
from services.engine.step_loop import StepLoop
from services.engine.worker_setup import set_up_workers
from services.scheduler.dp_wave import EngineWave, WaveCoordinator
from services.scheduler.kv_events import KvEventLog, SubscriberTooSlow
from services.scheduler.kv_producers import ProducerRegistry
from services.scheduler.load_reporter import LoadReporter
from services.scheduler.worker_group import WorkerGroup
from services.scheduler.worker_link import DEFAULT_ENGINE_TIMEOUT_S, WorkerFault, WorkerLink

logger = logging.getLogger("myvllm.scheduler")


class _ClientStream:
    """One gateway connection: where its requests' outputs go."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[pb.StepOutputs] = asyncio.Queue()
        self.request_ids: set[str] = set()


LOAD_HEARTBEAT_S = 1.0
# Retrying the set-up of a lost worker: from this delay, doubling, up to the max.
RECONNECT_BACKOFF_S = 0.5
MAX_RECONNECT_BACKOFF_S = 5.0
# An idle engine checks on its worker this often (a step would notice a dead one at once).
IDLE_PROBE_S = 2.0


class SchedulerServicer(pb_grpc.SchedulerServicer):
    def __init__(self, config: VllmConfig, worker: WorkerGroup, load_reporter: LoadReporter | None = None,
                 max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS, wave: EngineWave | None = None) -> None:
        self.config = config
        self.wave = wave  # a data-parallel expert-parallel group's engine: its part of the wave protocol
        # Set when this engine can no longer serve (a lockstep group's worker failed): why.
        self.group_fault: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.max_waiting_requests = max_waiting_requests
        self.worker = worker
        self.core: EngineCore | None = None
        self.steps: StepLoop | None = None
        self.owners: dict[str, _ClientStream] = {}
        self.work_available = asyncio.Event()
        self.load_reporter = load_reporter
        self.loop_task: asyncio.Task | None = None
        self.heartbeat_task: asyncio.Task | None = None
        # Why this replica cannot serve right now (None: the worker is set up and stepping).
        self.worker_down: str | None = None
        # Prefix-cache changes for gateways (SubscribeKvEvents); outlives engine cores.
        self.kv_events = KvEventLog(config.cache_config.block_size)
        # A GrpcConnector consumer with Redis: the producers the signed registry names.
        self.kv_producers: ProducerRegistry | None = None

    async def start(self) -> None:
        """Load the model on the worker, size the KV cache, start the engine loop."""
        try:
            info, num_blocks = await set_up_workers(self.worker, self.config, worker_owns_model=True)
        except grpc.aio.AioRpcError as e:
            raise StartupError(f"scheduler: worker at {self.worker.address} refused: {e.details()}") from None
        except ValueError as e:
            raise StartupError(f"scheduler: {e}") from None
        self._install(info, num_blocks)
        self.loop_task = asyncio.create_task(self._engine_loop())
        if self.load_reporter is not None:
            self.heartbeat_task = asyncio.create_task(self._heartbeat())

    def _install(self, info: pb.ModelInfo, num_blocks: int) -> None:
        """Build the engine core for what the worker reported (kept when a restarted worker
        reports the same, so counters survive)."""
        core = self.core
        if core is not None and core.model_info == info and core.scheduler.kv_cache_manager.block_pool.num_blocks \
                == num_blocks:
            return
        if core is not None:
            core.structured_output.close()  # (no request is left: the worker's loss ended them all)
            self.kv_events.cleared()  # a new core starts with an empty prefix cache
            self.kv_events.flush()
        # (Its worker's address as this scheduler dials it: GrpcConnector consumers fetch from there.)
        self.core = EngineCore(self.config, info, num_blocks, kv_producer_address=self.worker.links[0].address)
        self.core.scheduler.kv_cache_manager.block_pool.events = self.kv_events
        if isinstance(self.core.scheduler.kv.connector, KVTierScheduler):
            self.core.scheduler.kv.connector.events = self.kv_events  # (the tier's blocks too)
        self.steps = StepLoop(self.core, self.worker, self._route, self._after_step)
        if self.wave is not None:
            self.wave.attach(self.steps)
        # A request waiting only for its grammar (or its allowed-token row) must not wait for the idle probe.
        loop = asyncio.get_running_loop()
        self.core.structured_output.on_ready = lambda: loop.call_soon_threadsafe(self.work_available.set)
        logger.info("worker at %s: %s (%s on %s, attention backend %s), %d KV blocks", self.worker.address,
                    info.model, info.dtype, info.device, info.attention_backend, num_blocks)

    async def _heartbeat(self) -> None:
        """An idle engine takes no steps, so nothing else would refresh its Redis entry;
        gateways drop replicas whose entry goes stale."""
        while True:
            await asyncio.sleep(LOAD_HEARTBEAT_S)
            self._report_load()

    # ------------------------------------------------------------------ engine loop

    async def _engine_loop(self) -> None:
        """Run steps while there is work, probe the worker while there is none; when the worker
        fails, fail what was running and set it up again."""
        while True:
            try:
                while True:
                    await self.steps.run_while_busy()
                    self._after_step()  # (aborts free blocks between steps)
                    self.work_available.clear()
                    try:
                        await asyncio.wait_for(self.work_available.wait(), IDLE_PROBE_S)
                    except asyncio.TimeoutError:
                        await self.worker.probe()
            except WorkerFault as e:
                await self._worker_lost(str(e))
            except Exception as e:  # a bug in a step: the same clean slate, with the traceback logged
                logger.exception("engine step failed")
                await self._worker_lost(f"engine step failed: {type(e).__name__}: {e}")
            if self.wave is not None:
                # The group's process group is broken for every engine: it restarts as a whole.
                self.group_fault.set_result(
                    f"data-parallel expert-parallel engine {self.wave.dp_rank} lost its worker ({self.worker_down}); "
                    "the group's ranks share every MoE exchange, so the group stops (serve restarts it)")
                return
            await self._reconnect()

    def _after_step(self) -> None:
        self.kv_events.flush()  # this step's cache changes, as one batch
        self._report_load()

    async def _worker_lost(self, reason: str) -> None:
        logger.error("%s; failing every live request and setting the worker up again", reason)
        self.worker_down = reason
        await self.steps.fail_all(f"engine fault: {reason}")
        self.kv_events.flush()  # fail_all cleared the prefix cache: gateways must not route by it
        if self.load_reporter is not None:
            self.load_reporter.leave()

    async def _reconnect(self) -> None:
        """Set the worker up again (LoadModel, KV capacity, InitKVCache) until it works."""
        reason, backoff = self.worker_down, RECONNECT_BACKOFF_S
        while True:
            try:
                info, num_blocks = await set_up_workers(self.worker, self.config, worker_owns_model=True)
                break
            except grpc.aio.AioRpcError as e:
                detail = f"{e.code().name}: {e.details()}"
            except ValueError as e:
                detail = str(e)
            self.worker_down = f"{reason}; setting it up again failed ({detail})"
            logger.warning("worker at %s: %s", self.worker.address, self.worker_down)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_RECONNECT_BACKOFF_S)
        self._install(info, num_blocks)
        self.worker_down = None
        logger.info("worker at %s is back; serving again", self.worker.address)
        if self.load_reporter is not None:
            self.load_reporter.rejoin(self.core.load())
        self.work_available.set()

    def _route(self, outputs: list[pb.RequestOutput]) -> None:
        per_stream: dict[int, tuple[_ClientStream, pb.StepOutputs]] = {}
        for out in outputs:
            stream = self.owners.get(out.request_id)
            if stream is None:
                continue
            entry = per_stream.get(id(stream))
            if entry is None:
                entry = per_stream[id(stream)] = (stream, pb.StepOutputs())
            entry[1].outputs.append(out)
            if out.finish_reason:
                del self.owners[out.request_id]
                stream.request_ids.discard(out.request_id)
        for stream, step in per_stream.values():
            stream.queue.put_nowait(step)

    def _report_load(self) -> None:
        if self.load_reporter is not None:
            self.load_reporter.report(self.core.load())

    # ------------------------------------------------------------------ RPCs

    def _add(self, stream: _ClientStream, req: pb.GenerateRequest) -> None:
        error, kind = None, pb.INVALID_REQUEST
        if self.worker_down is not None:
            # Queueing would hold the request for as long as the worker stays away.
            error, kind = f"replica unavailable: {self.worker_down}", pb.UNAVAILABLE
        elif req.request_id in self.owners or not req.request_id:
            error = f"request id {req.request_id!r} is empty or already in use"
        elif self.core.scheduler.num_waiting >= self.max_waiting_requests:
            error, kind = (f"the scheduler's waiting queue is full ({self.max_waiting_requests} requests, "
                           "--max-waiting-requests); retry later"), pb.RESOURCE_EXHAUSTED
        else:
            try:
                if self.wave is not None:
                    check_request_wave(req.dp_wave)
                    self.wave.note_request(req.dp_wave)
                self.core.add_request(req)
            except ValueError as e:  # every refusal of add_request is about the request itself
                error = str(e)
        if error is not None:
            stream.queue.put_nowait(pb.StepOutputs(outputs=[pb.RequestOutput(
                request_id=req.request_id, finish_reason="abort", error=error, error_kind=kind, stop_token_id=-1)]))
            return
        self.owners[req.request_id] = stream
        stream.request_ids.add(req.request_id)
        self.work_available.set()

    def _abort(self, request_ids: list[str]) -> None:
        outputs = self.core.abort(request_ids)
        self._route(outputs)
        self.work_available.set()  # freed blocks may let waiting requests in

    async def _read_client(self, request_iterator, stream: _ClientStream) -> None:
        async for msg in request_iterator:
            kind = msg.WhichOneof("kind")
            if kind == "generate":
                await self._learn_kv_producer(msg.generate)
                self._add(stream, msg.generate)
            elif kind == "abort":
                self._abort([r for r in msg.abort.request_ids if self.owners.get(r) is stream])

    async def _learn_kv_producer(self, req: pb.GenerateRequest) -> None:
        """`req` names a producer worker this consumer does not know (yet): read the registry again
        (add_request then refuses it if it is still unknown there)."""
        connector = self.core.scheduler.kv.connector if self.core is not None else None
        if self.kv_producers is None or connector is None or not req.HasField("kv_transfer_params") \
                or connector.knows_source(req.kv_transfer_params):
            return
        addresses = await self.kv_producers.refresh()
        if self.core is not None and self.core.scheduler.kv.connector is not None:
            self.core.scheduler.kv.connector.registry_producers = addresses

    async def Generate(self, request_iterator, context: grpc.aio.ServicerContext):
        if self.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler is still starting")
        stream = _ClientStream()
        reader = asyncio.create_task(self._read_client(request_iterator, stream))
        getter: asyncio.Task | None = None
        try:
            while True:
                getter = asyncio.ensure_future(stream.queue.get())
                done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield getter.result()
                    continue
                getter.cancel()
                if reader.exception() is not None and not isinstance(reader.exception(), asyncio.CancelledError):
                    logger.warning("gateway stream failed: %s", reader.exception())
                # The client closed its side: flush what is queued for it, then end.
                while not stream.queue.empty() and stream.request_ids:
                    yield stream.queue.get_nowait()
                break
        finally:
            if getter is not None:
                getter.cancel()
            reader.cancel()
            # A gateway that went away cannot receive its outputs: free their blocks.
            if stream.request_ids:
                ids = list(stream.request_ids)
                for rid in ids:
                    self.owners.pop(rid, None)
                self.core.abort(ids)
                self.work_available.set()

    async def Health(self, request: pb.Empty, context) -> pb.HealthResponse:
        if self.core is None:
            return pb.HealthResponse(ok=False, detail="starting")
        if self.loop_task is not None and self.loop_task.done():
            return pb.HealthResponse(ok=False, detail=f"engine loop stopped: {self.loop_task.exception()}")
        if self.worker_down is not None:
            return pb.HealthResponse(ok=False, detail=f"no worker: {self.worker_down}")
        return pb.HealthResponse(ok=True, detail="ready")

    async def GetLoad(self, request: pb.Empty, context) -> pb.Load:
        if self.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler is still starting")
        return self.core.load()

    async def GetStats(self, request: pb.Empty, context) -> pb.Stats:
        if self.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler is still starting")
        stats = self.core.stats()
        if self.wave is not None:
            stats.dp_wave, stats.dp_engines_running = self.wave.wave, self.wave.running
            stats.dp_wave_messages_stale = self.wave.num_stale_messages
            stats.dp_wave_messages_replayed = self.wave.num_replayed_messages
        return stats

    async def SubscribeKvEvents(self, request: pb.Empty, context: grpc.aio.ServicerContext):
        try:
            async for batch in self.kv_events.subscribe():
                yield batch
        except SubscriberTooSlow as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))


def advertised_address(host: str, port: int) -> str:
    """The address gateways should dial: the bind host, unless that is a wildcard (then this
    machine's hostname)."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    return f"{host}:{port}"


async def serve_scheduler(host: str, port: int, config: VllmConfig, worker_addresses: list[str],
                          redis_url: str | None = None, engine_id: str | None = None,
                          connect_timeout: float = 120.0, advertise_address: str | None = None,
                          token: str | None = None, engine_timeout: float = DEFAULT_ENGINE_TIMEOUT_S,
                          max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS, data_parallel_rank: int = 0,
                          data_parallel_address: str | None = None, dp_group: str = "default") -> None:
    if not worker_addresses:
        raise StartupError("scheduler: give at least one worker address (several = tensor/pipeline-parallel ranks)")
    if engine_timeout <= 0:
        raise StartupError(f"scheduler: --engine-timeout must be positive, got {engine_timeout}")
    if max_waiting_requests < 1:
        raise StartupError(f"scheduler: --max-waiting-requests must be positive, got {max_waiting_requests}")
    address = advertise_address or advertised_address(host, port)
    group_init_method = _check_group(config, redis_url, data_parallel_rank, data_parallel_address, dp_group)
    # Several workers are one engine's ranks (tensor parallel x pipeline stages), stage-major; they
    # rendezvous at a store this scheduler hosts, on the host they reach it by (a data-parallel
    # expert-parallel group's ranks: at the one DP rank 0's scheduler hosts).
    store = None
    try:
        if group_init_method and data_parallel_rank == 0:
            from services.common.rendezvous import RendezvousStore

            group_host, _, group_port = data_parallel_address.rpartition(":")
            store = RendezvousStore(group_host, int(group_port))
        sched = config.scheduler_config
        answer_bytes = receive_limit(runner_output_bytes(sched.max_num_seqs, sched.max_num_batched_tokens,
                                                         drafts_per_step(config.speculative_config)))
        worker = WorkerGroup([WorkerLink(a, answer_bytes, token=token, engine_timeout=engine_timeout)
                              for a in worker_addresses],
                             config.parallel_config.tensor_parallel_size, config.parallel_config.pipeline_parallel_size,
                             rendezvous_host=host, advertise_host=address.rpartition(":")[0],
                             group_init_method=group_init_method, data_parallel_rank=data_parallel_rank)
    except (ValueError, RuntimeError) as e:
        raise StartupError(f"scheduler: {e}") from None
    await worker.connect(connect_timeout)
    extra = {"dp_group": dp_group, "dp_rank": data_parallel_rank} if group_init_method else {}
    kv = config.kv_transfer_config
    if kv is not None:  # gateways route prefills and decodes by it
        extra["kv_role"] = kv.kv_role
        if kv.crosses_hosts and kv.is_producer:  # (consumers fetch from there: kv_producers.py)
            extra[KV_ADDRESS_FIELD] = worker.links[0].address
    reporter = LoadReporter(redis_url, engine_id or address, address, token=token, extra=extra) if redis_url else None
    wave = None
    if group_init_method:
        import redis.asyncio as aioredis

        client = aioredis.from_url(redis_url)
        size = config.parallel_config.data_parallel_size
        coordinator = WaveCoordinator(client, dp_group, size, token) if data_parallel_rank == 0 else None
        wave = EngineWave(client, dp_group, data_parallel_rank, size, token, coordinator, wake=lambda: None)
        await wave.start()  # subscribed before the engine can step
    servicer = SchedulerServicer(config, worker, reporter, max_waiting_requests, wave)
    if reporter is not None and kv is not None and kv.crosses_hosts and kv.is_consumer:
        servicer.kv_producers = ProducerRegistry(reporter.client, token)
    if wave is not None:
        wave.wake = servicer.work_available.set
    started = time.monotonic()
    await servicer.start()
    # A client's message is one request (or an abort): its largest legal size follows from the
    # model's context length, known once the worker has loaded it.
    server = grpc_utils.server(receive_limit(generate_request_bytes(servicer.core.max_model_len)),
                               server_interceptors(token))
    pb_grpc.add_SchedulerServicer_to_server(servicer, server)
    grpc_utils.bind_or_fail(server, host, port, "scheduler")
    await server.start()
    logger.info("scheduler serving on %s:%d (ready in %.1fs)%s", host, port, time.monotonic() - started,
                " (internal token required)" if token else "")
    serving = asyncio.ensure_future(grpc_utils.serve_until_cancelled(server))
    try:
        await asyncio.wait({serving, servicer.group_fault}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        if wave is not None:
            await wave.close()
        if servicer.core is not None:
            # Killed, not left to notice its closed stdin: it runs at the lowest CPU priority, and on
            # a busy machine it could outlive this process by minutes.
            servicer.core.structured_output.close()
        del store  # (the group's rendezvous lives as long as this scheduler)
    if servicer.group_fault.done():
        raise StartupError(f"scheduler: {servicer.group_fault.result()}")


def _check_group(config: VllmConfig, redis_url: str | None, rank: int, address: str | None,
                 group: str) -> str | None:
    """For an engine of a data-parallel expert-parallel group: the init method its workers join
    the group's process group by (None for an engine of its own). Raises StartupError naming the
    flag that is missing or wrong."""
    if not config.expert_parallel_group:
        return None
    size = config.parallel_config.data_parallel_size
    if not 0 <= rank < size:
        raise StartupError(f"scheduler: --data-parallel-rank {rank} is outside [0, --data-parallel-size {size})")
    if not redis_url:
        raise StartupError("scheduler: --data-parallel-size > 1 with --enable-expert-parallel needs --redis (the DP "
                           "coordinator's wave state lives there)")
    if not is_group_name(group):
        raise StartupError(f"scheduler: --dp-group must be a name of at most 64 characters without spaces or ':', "
                           f"got {group!r}")
    host, _, port = (address or "").rpartition(":")
    if not host or not port.isdigit():
        raise StartupError("scheduler: --data-parallel-size > 1 with --enable-expert-parallel needs "
                           "--data-parallel-address HOST:PORT (where DP rank 0's scheduler hosts the group's "
                           f"rendezvous), got {address!r}")
    return f"tcp://{host}:{port}/0"
