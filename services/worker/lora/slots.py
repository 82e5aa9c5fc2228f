"""The slot table: the adapters a step may use, stacked per layer so that the tokens of one slot
take one shrink and one expand product per layer group. The scheduler assigns the slots
(NewRequestData.lora_slot); a slot not holding an adapter holds zeros.

Layer groups follow the decoder's fused projections: `qkv` (q|k|v columns of qkv_proj, one shrink
over the shared input, one expand per part), `o` (o_proj), `gate_up` (gate|up) and `down`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.lora.adapter import LoraAdapter, ModuleShape
from services.worker.lora.apply import LoraBatch, add_lora

# group -> the modules whose outputs it writes, in column order
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}


@dataclass
class GroupTable:
    a: torch.Tensor              # [layers, slots, parts * max_rank, in]
    bs: list[torch.Tensor]       # per part: [layers, slots, out_part, max_rank]
    columns: list[tuple[int, int]]  # per part: its output column range in the fused projection


class LoraSlots:
    def __init__(self, num_layers: int, max_loras: int, max_lora_rank: int, shapes: dict[str, ModuleShape],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers, self.max_loras, self.max_rank = num_layers, max_loras, max_lora_rank
        self.shapes = shapes
        self.groups: dict[str, GroupTable] = {}
        for group, modules in GROUPS.items():
            in_features = shapes[modules[0]].in_features
            a = torch.zeros(num_layers, max_loras, len(modules) * max_lora_rank, in_features, dtype=dtype,
                            device=device)
            bs, columns, start = [], [], 0
            for module in modules:
                out = shapes[module].out_features
                bs.append(torch.zeros(num_layers, max_loras, out, max_lora_rank, dtype=dtype, device=device))
                columns.append((start, start + out))
                start += out
            self.groups[group] = GroupTable(a, bs, columns)
        self.held: list[int] = [0] * max_loras  # lora_int_id per slot, 0 = empty

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Write `adapter` into `slot` (zeros where it adapts nothing)."""
        r = adapter.rank
        for group, modules in GROUPS.items():
            table = self.groups[group]
            table.a[:, slot].zero_()
            for part, module in enumerate(modules):
                table.bs[part][:, slot].zero_()
                for layer in range(self.num_layers):
                    weights = adapter.weights.get((layer, module))
                    if weights is None:
                        continue
                    a, b = weights
                    table.a[layer, slot, part * self.max_rank:part * self.max_rank + r].copy_(a)
                    table.bs[part][layer, slot, :, :r].copy_(b)
        self.held[slot] = adapter.lora_int_id

    def layer(self, index: int) -> LayerLora:
        return LayerLora(self, index)


class LayerLora:
    """One decoder layer's view of the slot table (what its projections add)."""

    def __init__(self, slots: LoraSlots, index: int) -> None:
        self.slots, self.index = slots, index

    def add(self, group: str, y: torch.Tensor, x: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        return add_lora(y, x, self.slots.groups[group], self.index, batch)
