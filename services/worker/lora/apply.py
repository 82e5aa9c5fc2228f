"""Adding the adapters' products to a projection's output, token by token by slot (Punica's
SGMV, shrink then expand): the step's tokens are grouped by slot once (`LoraBatch`), and each
group of each layer takes one shrink product over the fused projection's shared input and one
expand product per output part, as plain GEMMs over that slot's rows. Base-only tokens are not
touched."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # slots.py imports this module
    from services.worker.lora.slots import GroupTable


@dataclass
class LoraBatch:
    """The step's tokens grouped by adapter slot: (slot, row indices or None for every row)."""

    groups: list[tuple[int, torch.Tensor | None]]

    @classmethod
    def from_token_slots(cls, token_slots: np.ndarray, device: torch.device) -> LoraBatch | None:
        """None when no token uses an adapter (the step runs exactly as without LoRA)."""
        used = np.unique(token_slots)
        used = used[used >= 0]
        if used.size == 0:
            return None
        if used.size == 1 and bool((token_slots == used[0]).all()):
            return cls([(int(used[0]), None)])
        return cls([(int(s), torch.from_numpy(np.flatnonzero(token_slots == s)).to(device)) for s in used])


def add_lora(y: torch.Tensor, x: torch.Tensor, table: "GroupTable", layer: int, batch: LoraBatch) -> torch.Tensor:
    """y[t, part columns] += B_part[slot_t] @ (A[slot_t] @ x[t]) for every adapted token t; in place
    into `y` (the projection's own output), which it returns."""
    r = table.bs[0].shape[-1]
    for slot, rows in batch.groups:
        xs = x if rows is None else x.index_select(0, rows)
        shrunk = xs @ table.a[layer, slot].t()  # [n, parts * r]
        for part, (start, end) in enumerate(table.columns):
            delta = shrunk[:, part * r:(part + 1) * r] @ table.bs[part][layer, slot].t()
            if rows is None:
                y[:, start:end] += delta
            else:
                y[:, start:end].index_add_(0, rows, delta)
    return y
