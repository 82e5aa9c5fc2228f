"""The KV connector's scheduler side (prefill/decode disaggregation), vLLM's KVConnector shape.

Consumer (kv_consumer / kv_both), for a request with do_remote_prefill:
  `get_num_new_matched_tokens`: how many prompt tokens past the local prefix-cache hits the
  producer's segment holds (whole blocks, never the prompt's last token: it must be computed here
  to sample). The scheduler allocates blocks for them (not yet in the prefix cache) and parks the
  request in WAITING_FOR_REMOTE_KVS, holding its blocks but not a batch slot;
  `update_state_after_alloc` queues the load (segment blocks -> block ids) for the next step's
  metadata. The worker reports the load finished (finished_recving) or failed (failed_recving): the
  request then counts those tokens computed (and caches their blocks), or computes its prompt
  itself. Either way it never asks again.
Producer (kv_producer / kv_both), for a request with do_remote_decode:
  `request_saves`: in the step that completes its prompt, a save of the prompt's full blocks (the
  worker writes them after that step's forward). `request_finished`: the params for the consumer,
  and whether the request's blocks must outlive it until the worker reports the save done
  (finished_sending).
Who frees what: the scheduler frees a finished producer request's blocks on finished_sending, an
aborted loading request's on finished/failed_recving; the consumer's worker unlinks a segment once
it has read it (or was told to discard it); the producer's worker unlinks its own segments after
segment_ttl_s (a consumer that never came) and when it closes.
"""

from __future__ import annotations

import uuid

from services.common.kv_transfer_config import KVTransferConfig
from services.common.kv_transfer_params import check_source
from services.common.proto import myvllm_pb2 as pb
from services.engine.kv_cache_manager import extend_block_hashes
from services.engine.request import Request


def new_handle() -> str:
    """A segment name no other producer picks (services/common/kv_transfer_params.py HANDLE_RE)."""
    return f"mvkv-{uuid.uuid4().hex}"


class KVConnectorScheduler:
    def __init__(self, config: KVTransferConfig, block_size: int, producer_address: str | None = None) -> None:
        """`producer_address`: host:port of this engine's worker for other engines' workers
        (GrpcConnector: the consumer's worker fetches segments from there)."""
        self.config = config
        self.block_size = block_size
        self.producer_host, self.producer_port = None, 0
        if config.crosses_hosts and config.is_producer:
            host, _, port = (producer_address or "").rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"a {config.kv_connector} producer needs its worker's host:port, got "
                                 f"{producer_address!r} (run it as a served engine: myvllm serve / scheduler)")
            self.producer_host, self.producer_port = host, int(port)
        # GrpcConnector consumer: the producer workers its worker may present the internal token to,
        # configured, and (a served engine with Redis) the kv_producer entries of the signed registry.
        self.registry_producers: frozenset[str] = frozenset()
        self._loads: list[pb.KVLoad] = []
        self._saves: list[pb.KVSave] = []
        self._discards: list[str] = []
        self.loading: dict[str, int] = {}   # request id -> tokens its load brings, until reported
        self.saving: set[str] = set()       # request ids whose save was sent, until reported
        # What happened, for stats (/metrics) and tests.
        self.num_loads = 0
        self.num_loaded_tokens = 0
        self.num_load_failures = 0
        self.num_saves = 0          # sent to the worker
        self.num_saves_done = 0     # reported by it
        self.saved_bytes = 0
        self.loaded_bytes = 0
        self.save_seconds = 0.0
        self.load_seconds = 0.0

    # ------------------------------------------------------------------ consumer

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens past `num_computed_tokens` (local hits) that `request` may load from its producer
        (0: compute them here). Decided once per request: the segment is read once."""
        params = request.kv_transfer_params
        if not self.config.is_consumer or params is None or not params.do_remote_prefill or request.kv_load_decided:
            return 0
        request.kv_load_decided = True
        if not params.remote_handle:
            return 0  # the producer saved nothing (a prompt shorter than a block and one token)
        bs = self.block_size
        n = params.remote_num_tokens
        num_blocks = n // bs
        extend_block_hashes(request, bs)
        usable = n > 0 and n % bs == 0 and n <= ((request.num_prompt_tokens - 1) // bs) * bs
        # (A segment this engine's transport can fetch: a worker address exactly for GrpcConnector.)
        usable = usable and bool(params.remote_host) == self.config.crosses_hosts
        if usable:
            # The segment must be this request's prompt (same tokens, same cache salt): its last
            # block's chained hash says so for every block before it too.
            usable = len(request.block_hashes) >= num_blocks and \
                request.block_hashes[num_blocks - 1] == params.remote_block_hash
        if not usable or n <= num_computed_tokens:
            self._discards.append(params.remote_handle)  # nobody else will read it
            return 0
        return n - num_computed_tokens

    def check_source(self, params: pb.KVTransferParams) -> None:
        """ValueError unless the producer worker `params` name is one this engine may fetch from."""
        if self.config.crosses_hosts:
            check_source(params, self.config.producer_addresses | self.registry_producers)

    def knows_source(self, params: pb.KVTransferParams) -> bool:
        try:
            self.check_source(params)
        except ValueError:
            return False
        return True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_computed_tokens: int,
                                 num_external_tokens: int) -> None:
        """The request's blocks are allocated: load the segment's blocks past its local hits."""
        bs = self.block_size
        first, count = num_computed_tokens // bs, num_external_tokens // bs
        params = request.kv_transfer_params
        self._loads.append(pb.KVLoad(request_id=request.request_id, handle=params.remote_handle,
                                     first_block=first, block_ids=block_ids[first:first + count],
                                     block_hashes=request.block_hashes[first:first + count],
                                     remote_host=params.remote_host, remote_port=params.remote_port))
        self.loading[request.request_id] = num_external_tokens

    def load_finished(self, request_id: str, ok: bool) -> int | None:
        """The worker's report on a load: the tokens it brought (0 if it failed); None if no load of
        that request was in flight."""
        num_tokens = self.loading.pop(request_id, None)
        if num_tokens is None:
            return None
        if not ok:
            self.num_load_failures += 1
            return 0
        self.num_loads += 1
        self.num_loaded_tokens += num_tokens
        return num_tokens

    # ------------------------------------------------------------------ producer

    def request_saves(self, request: Request, num_new: int, block_ids: list[int]) -> None:
        """`request` is scheduled for `num_new` tokens past its computed ones: if that completes
        the prompt of a do_remote_decode request, save its full blocks after this step."""
        params = request.kv_transfer_params
        if not self.config.is_producer or params is None or not params.do_remote_decode \
                or request.kv_save_handle is not None \
                or request.num_computed_tokens + num_new < request.num_prompt_tokens:
            return
        num_blocks = (request.num_prompt_tokens - 1) // self.block_size
        request.kv_save_handle = ""  # decided: nothing to save unless a whole block
        if num_blocks == 0:
            return
        extend_block_hashes(request, self.block_size)
        request.kv_save_handle = new_handle()
        self._saves.append(pb.KVSave(request_id=request.request_id, handle=request.kv_save_handle,
                                     block_ids=block_ids[:num_blocks],
                                     block_hashes=request.block_hashes[:num_blocks]))
        self.saving.add(request.request_id)
        self.num_saves += 1

    def request_finished(self, request: Request, aborted: bool) -> tuple[bool, pb.KVTransferParams | None]:
        """(whether the request's blocks must wait for its save, the params its final output
        carries for the consumer). An aborted request's segment is discarded once saved."""
        params = request.kv_transfer_params
        if not self.config.is_producer or params is None or not params.do_remote_decode:
            return False, None
        handle = request.kv_save_handle
        delay = request.request_id in self.saving
        if aborted:
            if handle:
                request.kv_discard_after_save = True
                if not delay:
                    self._discards.append(handle)
            return delay, None
        if not handle:
            return delay, pb.KVTransferParams(do_remote_prefill=True)  # nothing to load: prefill there
        num_blocks = (request.num_prompt_tokens - 1) // self.block_size
        return delay, pb.KVTransferParams(do_remote_prefill=True, remote_handle=handle,
                                          remote_num_tokens=num_blocks * self.block_size,
                                          remote_block_hash=request.block_hashes[num_blocks - 1],
                                          remote_host=self.producer_host or "", remote_port=self.producer_port)

    def save_finished(self, request_id: str) -> bool:
        """The worker's report on a save; whether a save of that request was in flight."""
        if request_id not in self.saving:
            return False
        self.saving.discard(request_id)
        self.num_saves_done += 1
        return True

    def observe(self, runner_output: pb.ModelRunnerOutput) -> None:
        """Count the bytes and seconds of the transfers the worker reports in `runner_output`."""
        self.saved_bytes += runner_output.kv_saved_bytes
        self.loaded_bytes += runner_output.kv_loaded_bytes
        self.save_seconds += runner_output.kv_save_seconds
        self.load_seconds += runner_output.kv_load_seconds

    def stats(self) -> dict[str, float | str]:
        """Stats fields (proto Stats.kv_transfer_*, kv_role)."""
        return {"kv_role": self.config.kv_role, "kv_transfer_saves": self.num_saves_done,
                "kv_transfer_loads": self.num_loads, "kv_transfer_load_failures": self.num_load_failures,
                "kv_transfer_loaded_tokens": self.num_loaded_tokens, "kv_transfer_saved_bytes": self.saved_bytes,
                "kv_transfer_loaded_bytes": self.loaded_bytes, "kv_transfer_save_seconds": self.save_seconds,
                "kv_transfer_load_seconds": self.load_seconds}

    def discard_later(self, handle: str) -> None:
        self._discards.append(handle)

    # ------------------------------------------------------------------ every step

    @property
    def has_pending(self) -> bool:
        """Transfers in flight or to send: the worker must see steps until they are reported."""
        return bool(self.loading or self.saving or self._loads or self._saves or self._discards)

    def build_connector_meta(self) -> pb.KVConnectorMetadata | None:
        """This step's metadata (None when no transfer is pending at all)."""
        if not self.has_pending:
            return None
        meta = pb.KVConnectorMetadata(loads=self._loads, saves=self._saves, discard_handles=self._discards)
        self._loads, self._saves, self._discards = [], [], []
        return meta

    def reset(self) -> None:
        """The worker lost its state (and its transfer jobs): nothing is in flight any more."""
        self._loads, self._saves, self._discards = [], [], []
        self.loading.clear()
        self.saving.clear()
