"""The slot table: the adapters a step may use (--max-loras slots, which the scheduler assigns:
NewRequestData.lora_slot), stacked per layer as services/worker/lora/apply.py multiplies them. A
slot not holding an adapter holds zeros, as do an adapter's rows beyond its rank and the modules
it does not adapt.

Layer groups follow the decoder's fused projections: `qkv` (q|k|v columns of qkv_proj), `o`
(o_proj), `gate_up` (gate|up) and `down`. Per group and layer: A [parts x slots x rank, in]
(part-major) and B [out, parts x slots x rank], block-diagonal over the parts (part p's output
columns read only part p's rank columns); both padded with zeros to a width that is a multiple of
the packed GEMM's block, so that every table packs for it."""

from __future__ import annotations

import torch

from services.worker.cpu.gemm import BLOCK, PanelGemm
from services.worker.lora.adapter import LoraAdapter, ModuleShape
from services.worker.lora.apply import GroupTable, LoraBatch, add_lora

# group -> the modules whose outputs it writes, in column order
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}


class LoraSlots:
    def __init__(self, num_layers: int, max_loras: int, max_lora_rank: int, shapes: dict[str, ModuleShape],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers, self.max_loras, self.max_rank = num_layers, max_loras, max_lora_rank
        self.dtype, self.device = dtype, device
        self.groups: dict[str, GroupTable] = {}
        for group, modules in GROUPS.items():
            width = -(-len(modules) * max_loras * max_lora_rank // BLOCK) * BLOCK
            columns, start = [], 0
            for module in modules:
                columns.append((start, start + shapes[module].out_features))
                start += shapes[module].out_features
            self.groups[group] = GroupTable(
                torch.zeros(num_layers, width, shapes[modules[0]].in_features, dtype=dtype, device=device),
                torch.zeros(num_layers, start, width, dtype=dtype, device=device), len(modules), columns)
        self.held: list[int] = [0] * max_loras  # lora_int_id per slot, 0 = empty
        self.gemm = PanelGemm.load() if device.type == "cpu" else None
        if self.gemm is not None and not all(self.gemm.supports(t.a[0]) and self.gemm.supports(t.b[0])
                                             for t in self.groups.values()):
            self.gemm = None
        self._pack()

    def _pack(self) -> None:
        """(Re)pack every table in place: the packed C step holds their addresses."""
        if self.gemm is None:
            return
        for table in self.groups.values():
            if table.a_packed is None:
                table.a_packed, table.b_packed = torch.empty_like(table.a), torch.empty_like(table.b)
            for layer in range(self.num_layers):
                self.gemm.pack(table.a[layer], out=table.a_packed[layer])
                self.gemm.pack(table.b[layer], out=table.b_packed[layer])

    def _rank_columns(self, part: int, slot: int) -> slice:
        first = (part * self.max_loras + slot) * self.max_rank
        return slice(first, first + self.max_rank)

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Write `adapter` into `slot` (zeros where it adapts nothing)."""
        r = adapter.rank
        for group, modules in GROUPS.items():
            table = self.groups[group]
            for part, module in enumerate(modules):
                ranks = self._rank_columns(part, slot)
                start, end = table.columns[part]
                table.a[:, ranks].zero_()
                table.b[:, start:end, ranks].zero_()
                for layer in range(self.num_layers):
                    weights = adapter.weights.get((layer, module))
                    if weights is not None:
                        a, b = weights
                        table.a[layer, ranks.start:ranks.start + r].copy_(a)
                        table.b[layer, start:end, ranks.start:ranks.start + r].copy_(b)
        self._pack()
        self.held[slot] = adapter.lora_int_id

    def batch(self, token_slots) -> LoraBatch | None:
        return LoraBatch.from_token_slots(token_slots, self.max_loras, self.max_rank, self.dtype, self.device)

    def layer(self, index: int) -> LayerLora:
        return LayerLora(self, index)


class LayerLora:
    """One decoder layer's view of the slot table (what its projections add)."""

    def __init__(self, slots: LoraSlots, index: int) -> None:
        self.slots, self.index = slots, index

    def add(self, group: str, y: torch.Tensor, x: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
        return add_lora(y, x, self.slots.groups[group], self.index, batch, self.slots.gemm)
