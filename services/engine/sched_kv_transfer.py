"""The scheduler's part of prefill/decode disaggregation and of the KV tier: requests whose prompt
KV a load fills (from a producer, or from the tier), ended requests whose blocks a transfer still
uses, and producers' final outputs held until their save is reported. Inert without a KV
connector (no kv_transfer_config, no --kv-offloading-size)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from services.common import message_limits
from services.common.kv_transfer_config import KVTransferConfig
from services.common.message_limits import STEP_BUDGET_BYTES
from services.common.proto import myvllm_pb2 as pb
from services.engine.kv_cache_manager import KVCacheManager
from services.engine.kv_connector import KVConnectorScheduler
from services.engine.kv_tier import KVTierScheduler
from services.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class KVTransferHooks:
    def __init__(self, config: KVTransferConfig | None, kv_cache_manager: KVCacheManager,
                 requeue: Callable[[Request], None], producer_address: str | None = None,
                 offloading: bool = False) -> None:
        """`requeue`: puts a request back at the head of the waiting queue (the policy's place);
        `offloading`: the engine keeps a KV tier (its connector, in place of a P/D one)."""
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.requeue = requeue
        self.connector: KVConnectorScheduler | KVTierScheduler | None = None
        if config is not None:
            self.connector = KVConnectorScheduler(config, self.block_size, producer_address)
        elif offloading:
            self.connector = KVTierScheduler(self.block_size)
            kv_cache_manager.block_pool.on_evict = self.connector.offer
            kv_cache_manager.block_pool.on_cache = self.connector.store
        # Requests whose blocks a remote load fills (they hold blocks, not a batch slot), and ended
        # requests whose blocks wait for a transfer to end (a producer's save, an aborted
        # consumer's load) before they are freed.
        self.waiting_for_remote: dict[str, Request] = {}
        self.finishing: dict[str, Request] = {}
        # A producer's final output, held until its save is reported: the handle it carries then
        # names a whole segment, so the consumer it goes to never waits for one or reads half.
        self.held_outputs: dict[str, pb.RequestOutput] = {}

    @property
    def saving(self) -> set[str] | tuple:
        """Requests whose KV save is in flight (the worker still reads their blocks)."""
        return self.connector.saving if self.connector is not None else ()

    @property
    def has_pending(self) -> bool:
        return bool(self.waiting_for_remote or self.finishing
                    or (self.connector is not None and self.connector.has_pending))

    def finish(self, request: Request, aborted: bool) -> pb.KVTransferParams | None:
        """`request` ended: its blocks are freed now, or once a transfer using them ends. Returns
        the KV transfer params its final output carries (a producer's), if any."""
        delay, params = False, None
        if self.connector is not None:
            delay, params = self.connector.request_finished(request, aborted)
            delay = delay or request.request_id in self.connector.loading
        if delay:
            self.finishing[request.request_id] = request
        else:
            self.kv_cache_manager.free(request)
        return params

    def abort_held(self, request_id: str) -> Request | None:
        """Abort an ended request whose save is not yet reported: nobody will read its segment."""
        if self.held_outputs.pop(request_id, None) is None:
            return None
        request = self.finishing[request_id]
        request.kv_discard_after_save = True
        return request

    def hold(self, out: pb.RequestOutput, params: pb.KVTransferParams) -> bool:
        """Hold a producer's final output until its save is reported; False if there is none."""
        if params.remote_handle and out.request_id in self.finishing:
            self.held_outputs[out.request_id] = out
            return True
        return False

    def take_held_outputs(self) -> list[pb.RequestOutput]:
        """The held final outputs (the worker failed: their saves will never be reported)."""
        held, self.held_outputs = list(self.held_outputs.values()), {}
        return held

    def transfer_ended(self, request_id: str) -> None:
        """A transfer of an ended request is over: its blocks go back now."""
        request = self.finishing.pop(request_id, None)
        if request is not None:
            self.kv_cache_manager.free(request)

    def reset(self) -> None:
        """The worker is gone, and its transfers with it."""
        for rid in list(self.finishing):
            self.transfer_ended(rid)
        if self.connector is not None:
            self.connector.reset()

    def try_remote_load(self, request: Request, hit_blocks: list, num_hit_tokens: int, step_bytes: int,
                        max_num_seqs: int) -> int | None:
        """For a waiting request with no computed tokens: whether its producer holds KV it can load.
        None: no (compute it here); 0: yes, but not now (it waits, as the queue behind it does);
        else the step's message bytes its load adds (the request is now parked until the load is
        reported)."""
        num_external = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
        if not num_external:
            return None
        # At most max_num_seqs loads in flight, each within the step's message.
        load_bytes = message_limits.kv_transfer_bytes(len(request.request_id), request.num_tokens // self.block_size)
        if len(self.waiting_for_remote) >= max_num_seqs or step_bytes + load_bytes > STEP_BUDGET_BYTES \
                or not self._wait_for_remote_kvs(request, hit_blocks, num_hit_tokens, num_external):
            request.kv_load_decided = False  # (asked again next time)
            return 0
        return load_bytes

    def _wait_for_remote_kvs(self, request: Request, hit_blocks: list, num_hit_tokens: int,
                             num_external: int) -> bool:
        """Allocate `request`'s blocks for its local hits and the `num_external` tokens its producer
        holds (not cached until loaded) and park it until the worker reports the load; False when
        the pool cannot supply them. (The caller takes it off the waiting queue.)"""
        kv = self.kv_cache_manager
        if kv.allocate_slots(request, num_external, hit_blocks, delay_cache_blocks=True) is None:
            return False
        if kv.enable_prefix_caching:
            kv.record_prefix_lookup(request.num_tokens, num_hit_tokens)
        request.num_computed_tokens = num_hit_tokens
        request.num_cached_tokens = num_hit_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote[request.request_id] = request
        self.connector.update_state_after_alloc(request, kv.block_ids(request.request_id), num_hit_tokens,
                                                num_external)
        return True

    def after_step(self, out: pb.SchedulerOutput, scheduled: list[tuple[Request, int]]) -> None:
        """Producer: the prompts this step completes are saved after it; the step carries the
        connector's metadata (loads and saves to start)."""
        if self.connector is None:
            return
        for request, num_new in scheduled:
            self.connector.request_saves(request, num_new, self.kv_cache_manager.block_ids(request.request_id))
        meta = self.connector.build_connector_meta()
        if meta is not None:
            out.kv_connector_metadata.CopyFrom(meta)

    def update_from_output(self, runner_output: pb.ModelRunnerOutput) -> list[pb.RequestOutput]:
        """The worker's transfer reports (vLLM's update_from_kv_xfer_finished). A finished save
        frees an ended producer request's blocks and releases its held final output; a finished
        load makes its request schedulable with those tokens computed (their blocks now cached), a
        failed one makes it compute its prompt itself."""
        connector = self.connector
        released: list[pb.RequestOutput] = []
        if connector is None:
            return released
        connector.observe(runner_output)
        for rid in runner_output.finished_sending:
            if connector.save_finished(rid):
                request = self.finishing.get(rid)
                if request is not None and request.kv_discard_after_save:
                    connector.discard_later(request.kv_save_handle)
                held = self.held_outputs.pop(rid, None)
                if held is not None:
                    released.append(held)
                self.transfer_ended(rid)
        reports = [(rid, True) for rid in runner_output.finished_recving]
        reports += [(rid, False) for rid in runner_output.failed_recving]
        for rid, ok in reports:
            num_loaded = connector.load_finished(rid, ok)
            if num_loaded is None:
                continue
            request = self.waiting_for_remote.pop(rid, None)
            if request is None:
                self.transfer_ended(rid)  # aborted while loading
                continue
            if num_loaded:
                request.num_computed_tokens += num_loaded
                self.kv_cache_manager.cache_full_blocks(request, request.num_computed_tokens)
            else:
                logger.warning("request %s: loading its prompt's KV failed; computing it here", rid)
                self.kv_cache_manager.free(request)
                request.num_computed_tokens = 0
                request.num_cached_tokens = -1
            request.status = RequestStatus.WAITING
            self.requeue(request)
        return released

    def stats(self) -> dict[str, float | str]:
        return self.connector.stats() if self.connector is not None else {}
