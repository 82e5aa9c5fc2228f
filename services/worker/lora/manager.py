"""The worker's LoRA state: the slot table bound into the decoder's layers, and a host cache of
read adapters (least recently used dropped first) so that a slot is refilled without rereading
the file. An adapter that fails to load fails the requests that name it, not the worker."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from services.common.config import LoRAConfig
from services.common.lora_adapter_config import AdapterConfigError
from services.common.message_limits import MAX_ERROR_CHARS
from services.common.proto import myvllm_pb2 as pb
from services.worker.input_batch import InputBatch
from services.worker.lora.adapter import LoraAdapter, ModuleShape, load_adapter
from services.worker.lora.apply import LoraBatch
from services.worker.lora.slots import LoraSlots


def module_shapes(model: nn.Module) -> dict[str, ModuleShape]:
    """The adaptable projections' widths, from the model's first layer (all layers alike)."""
    layer = next(iter(model._stage()))
    attn, hidden = layer.self_attn, int(model.config.hidden_size)
    shapes = {"q_proj": ModuleShape(hidden, attn.q_size), "k_proj": ModuleShape(hidden, attn.kv_size),
              "v_proj": ModuleShape(hidden, attn.kv_size), "o_proj": ModuleShape(attn.q_size, hidden)}
    inter = layer.mlp.intermediate_size
    shapes.update(gate_proj=ModuleShape(hidden, inter), up_proj=ModuleShape(hidden, inter),
                  down_proj=ModuleShape(inter, hidden))
    return shapes


class LoraManager:
    def __init__(self, config: LoRAConfig, model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        if model.moe_blocks():
            raise ValueError("LoRA adapters on mixture-of-experts models are not supported yet (--enable-lora)")
        self.config = config
        self.dtype, self.device = dtype, device
        self.num_layers = int(model.config.num_hidden_layers)
        self.shapes = module_shapes(model)
        self.slots = LoraSlots(self.num_layers, config.max_loras, config.max_lora_rank, self.shapes, dtype, device)
        for index, layer in enumerate(model.layers):
            layer.self_attn.lora = self.slots.layer(index)
            layer.mlp.lora = self.slots.layer(index)
        # the packed C step adds the adapters' products itself where it can read the tables
        if getattr(model, "packed_step", None) is not None:
            model.packed_step.bind_lora(self.slots)
        self.cache: OrderedDict[int, LoraAdapter] = OrderedDict()
        # Requests left out of a step because their adapter failed to load, with that step's id.
        # With async scheduling the next step was scheduled before the failure was reported and
        # continues them as cached requests this worker never held: they are skipped there.
        self.left_out: dict[str, int] = {}

    def skip_left_out(self, so: pb.SchedulerOutput) -> pb.SchedulerOutput:
        """`so` without the requests left out of an earlier step (forgotten two steps later: by
        then the scheduler has ended them and schedules them no more)."""
        self.left_out = {rid: step for rid, step in self.left_out.items() if so.step_id - step <= 2}
        if not self.left_out or not any(r.request_id in self.left_out for r in so.cached_requests):
            return so
        return without_requests(so, set(self.left_out))

    def _adapter(self, request: pb.LoRARequest) -> LoraAdapter:
        adapter = self.cache.get(request.lora_int_id)
        if adapter is None:
            adapter = load_adapter(request.lora_path, request.lora_int_id, self.config.max_lora_rank,
                                   self.num_layers, self.shapes, self.dtype)
            self.cache[request.lora_int_id] = adapter
            while len(self.cache) > self.config.max_cpu_loras:
                self.cache.popitem(last=False)
        self.cache.move_to_end(request.lora_int_id)
        return adapter

    def activate(self, slot: int, request: pb.LoRARequest) -> None:
        """Make `slot` hold the request's adapter (raises AdapterConfigError if it cannot be read)."""
        if self.slots.held[slot] != request.lora_int_id:
            self.slots.held[slot] = 0  # a failed load leaves the slot empty, never half-written
            self.slots.load(slot, self._adapter(request))
        elif request.lora_int_id in self.cache:
            self.cache.move_to_end(request.lora_int_id)

    def batch(self, token_slots: np.ndarray) -> LoraBatch | None:
        return self.slots.batch(token_slots)


def load_step_adapters(manager: LoraManager, so: pb.SchedulerOutput, batch: InputBatch,
                       ) -> tuple[pb.SchedulerOutput, list[pb.LoRALoadFailure]]:
    """Fill the slots the step's new requests name. A request whose adapter cannot be read is left
    out of the step (its scheduled tokens with it) and reported; the others run. Raises
    InvalidStep when the scheduler would put another adapter into a slot a live row uses."""
    from services.worker.step_validation import InvalidStep

    finished = set(so.finished_request_ids)
    live_slots = {int(batch.lora_slot[row]) for rid, row in batch.req_id_to_row.items() if rid not in finished}
    claimed: dict[int, int] = {}
    failed: dict[str, str] = {}
    for i, r in enumerate(so.new_requests):
        if not r.HasField("lora_request"):
            continue
        slot, lora_id = r.lora_slot, r.lora_request.lora_int_id
        if claimed.setdefault(slot, lora_id) != lora_id or (
                slot in live_slots and manager.slots.held[slot] != lora_id and r.request_id not in batch.req_id_to_row):
            raise InvalidStep(f"new_requests[{i}].lora_slot", f"slot {slot} holds another adapter that a "
                              "scheduled request uses")
        try:
            manager.activate(slot, r.lora_request)
        except AdapterConfigError as e:
            failed[r.request_id] = str(e)[:MAX_ERROR_CHARS]
    if not failed:
        return so, []
    manager.left_out.update((rid, so.step_id) for rid in failed)
    return without_requests(so, set(failed)), [pb.LoRALoadFailure(request_id=rid, error=error)
                                               for rid, error in failed.items()]


def without_requests(so: pb.SchedulerOutput, request_ids: set[str]) -> pb.SchedulerOutput:
    """A copy of `so` without these requests' new or cached entries and scheduled tokens (their
    grammar bitmask rows, keyed by request id, then match no row of the batch). A malformed `so`
    (tokens not parallel to the entries) is returned as it is, for validate_step to refuse."""
    entries = [(True, r) for r in so.new_requests] + [(False, r) for r in so.cached_requests]
    if len(entries) != len(so.num_scheduled_tokens):
        return so
    kept = pb.SchedulerOutput()
    kept.CopyFrom(so)
    del kept.new_requests[:]
    del kept.cached_requests[:]
    del kept.num_scheduled_tokens[:]
    for (new, r), tokens in zip(entries, so.num_scheduled_tokens, strict=True):
        if r.request_id not in request_ids:
            (kept.new_requests if new else kept.cached_requests).append(r)
            kept.num_scheduled_tokens.append(tokens)
    return kept
