"""QuantExperts: a mixture-of-experts block's local experts with their weights kept in GGUF
blocks, in place of moe.FusedExperts (same call: rows, routing weights, local expert ids).

Each expert holds its gate and up rows as one QuantWeights (gate rows, then up rows, as
FusedExperts' w13) and its down rows as another, so every product runs through
`ops.quant_matmul` on that expert's blocks. The tokens are grouped by expert as moe.py's torch
path groups them (a loop over the experts that have tokens, never over tokens), and each token's
expert outputs are added in ascending expert order, as there: on the same weights the two sum
alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.quant.ops import quant_matmul
from services.worker.quant.weights import QuantWeights


class QuantExperts(nn.Module):
    """`num_experts` local experts: gate_up[e] [2I, H] and down[e] [H, I] in quantized parts."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_up = nn.ModuleList(QuantWeights(hidden_size, 2 * intermediate_size) for _ in range(num_experts))
        self.down = nn.ModuleList(QuantWeights(intermediate_size, hidden_size) for _ in range(num_experts))
        self.dtype = dtype  # the activations' dtype (the blocks stay uint8)

    def empty_input(self) -> torch.Tensor:
        """No rows, in the activations' dtype and on the blocks' device (a dummy step's input)."""
        blocks = next(self.buffers(), None)
        return torch.empty((0, self.hidden_size), dtype=self.dtype, device=None if blocks is None else blocks.device)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights and ids [T, k] → [T, H] = sum over k of weight * down(silu(gate(x)) *
        up(x)) of that expert. An id outside [0, E) (an expert another rank holds) adds nothing."""
        top_k = ids.shape[1]
        flat_ids = ids.reshape(-1)
        # The (token, slot) pairs sorted by expert, stable: within an expert, in token order.
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids.clamp(-1, self.num_experts) + 1, minlength=self.num_experts + 2).tolist()
        token_of = order // top_k
        rows = x.index_select(0, token_of)
        out_rows = torch.empty_like(rows)
        lo = start = counts[0]  # ids below 0 sort first and are skipped
        for expert, n in enumerate(counts[1:self.num_experts + 1]):
            if n:
                gate, up = quant_matmul(rows[start:start + n], self.gate_up[expert]).chunk(2, dim=-1)
                out_rows[start:start + n] = quant_matmul(F.silu(gate) * up, self.down[expert])
            start += n
        held = slice(lo, start)
        scaled = (out_rows[held] * weights.reshape(-1)[order[held], None]).to(x.dtype)
        # index_add_ adds rows in order: each token's experts in ascending order.
        return torch.zeros_like(x).index_add_(0, token_of[held], scaled)
