"""Adding the adapters' products to a projection's output for every token at once, whatever
adapter slot each token runs with (Punica's BGMV, as two dense GEMMs): the shrink multiplies the
tokens by every slot's A (stacked: [parts x slots x rank, in]), a per-token mask keeps only the
columns of the token's own slot (zeros elsewhere and for base-only tokens), and the expand
multiplies by every slot's B (block-diagonal over the projection's fused parts) straight into the
projection's output. No gather, scatter or loop over slots or tokens: two GEMMs and one multiply
per projection, with work proportional to the slots (--max-loras) rather than to the adapters the
step uses, which is what keeps them dense. Exact zeros in the mask contribute nothing to the sums."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.worker.lora.cpu_lora import CpuLora

if TYPE_CHECKING:
    from services.worker.cpu.gemm import PanelGemm

# Up to this many tokens the per-token C kernel (cpu/lora_bgmv.c) adds the adapters' products: it
# reads only each token's own slot and costs one call, about half the dense products' time at one
# to a few tokens, but its per-column dots fall behind the GEMMs from ~8 tokens. Up to
# PACKED_GEMM_MAX_ROWS the packed GEMM multiplies them (twice torch's speed at decode sizes, level or
# behind at prefill sizes), torch's above.
BGMV_MAX_ROWS = 8
PACKED_GEMM_MAX_ROWS = 256


@dataclass
class GroupTable:
    """One fused projection's slot table (services/worker/lora/slots.py fills it)."""

    a: torch.Tensor                 # [layers, width, in]: parts * slots * max_rank rows, then zero rows
    b: torch.Tensor                 # [layers, out, width]
    parts: int
    columns: list[tuple[int, int]]  # per part: its output column range in the fused projection
    # CPU: a and b packed for gemm.c (None where it does not take them), which multiplies
    # decode-sized batches about twice as fast as torch, and which the packed C step reads (by
    # address: repacked in place whenever a slot changes).
    a_packed: torch.Tensor | None = None
    b_packed: torch.Tensor | None = None

    part_starts: torch.Tensor | None = None  # int32 [parts + 1]: each part's first column, then the end

    def __post_init__(self) -> None:
        self.part_starts = torch.tensor([start for start, _ in self.columns] + [self.columns[-1][1]],
                                        dtype=torch.int32, device=self.a.device)


@dataclass
class LoraBatch:
    """The step's tokens' slots as int32 slot numbers (-1: base; the kernels' and the packed C
    step's), and as a mask over every slot's rank columns (the dense products', made when first
    asked for)."""

    token_slots: torch.Tensor
    max_loras: int
    max_rank: int
    dtype: torch.dtype
    _by_shape: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def from_token_slots(cls, token_slots: np.ndarray, max_loras: int, max_rank: int, dtype: torch.dtype,
                         device: torch.device) -> LoraBatch | None:
        """None when no token uses an adapter (the step runs exactly as without LoRA)."""
        if not (token_slots >= 0).any():
            return None
        slots = torch.from_numpy(token_slots.astype(np.int32)).to(device)
        return cls(slots, max_loras, max_rank, dtype)

    @property
    def slot_mask(self) -> torch.Tensor:
        """[T, slots x rank]: ones in the token's own slot's rank columns."""
        one_hot = (self.token_slots.unsqueeze(1) == torch.arange(self.max_loras, device=self.token_slots.device))
        return one_hot.to(self.dtype).repeat_interleave(self.max_rank, dim=1)

    def mask(self, parts: int, width: int | None = None) -> torch.Tensor:
        """The mask for a fused projection of `parts` parts (columns part-major: part, slot, rank),
        zeros in the table's padding columns up to `width`."""
        width = parts * self.max_loras * self.max_rank if width is None else width
        if (parts, width) not in self._by_shape:
            mask = self.slot_mask.repeat(1, parts)
            self._by_shape[parts, width] = torch.nn.functional.pad(mask, (0, width - mask.shape[1]))
        return self._by_shape[parts, width]


def add_lora(y: torch.Tensor, x: torch.Tensor, table: GroupTable, layer: int, batch: LoraBatch,
             gemm: PanelGemm | None = None) -> torch.Tensor:
    """y[t] += B[slot_t] @ (A[slot_t] @ x[t]) for every adapted token t, each fused part into its
    columns; in place into `y` (the projection's own output), which it returns. `gemm`: the CPU's
    packed GEMM, taken for decode-sized batches (torch's is as fast on prefill-sized ones). On CUDA:
    the BGMV kernels (triton_lora.py), each token reading its own slot's weights only."""
    if y.is_cuda:
        from services.worker.lora import triton_lora  # (imports triton: CUDA only)

        return triton_lora.add_lora(y, x, table.a[layer], table.b[layer], batch.token_slots, table.columns,
                                    batch.max_loras, batch.max_rank)
    if x.shape[0] <= BGMV_MAX_ROWS and x.dtype in CpuLora.DTYPES and (kernel := CpuLora.load()) is not None:
        return kernel.add(y, x, table.a[layer], table.b[layer], batch.token_slots, table.part_starts,
                          batch.max_loras, batch.max_rank)
    width = table.a.shape[1]
    if gemm is not None and table.a_packed is not None and x.shape[0] <= PACKED_GEMM_MAX_ROWS:
        shrunk = gemm.matmul(x, table.a_packed[layer], None)
        shrunk.mul_(batch.mask(table.parts, width))
        return y.add_(gemm.matmul(shrunk, table.b_packed[layer], None))
    shrunk = x @ table.a[layer].t()
    shrunk.mul_(batch.mask(table.parts, width))
    if y.is_contiguous():
        return y.addmm_(shrunk, table.b[layer].t())
    return y.add_(shrunk @ table.b[layer].t())
