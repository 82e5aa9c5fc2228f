"""A shared expert (Qwen2-MoE): a dense SiLU MLP that every token of an MoE layer runs beside its
routed experts, its output scaled by sigmoid(`shared_expert_gate`(x)) and added to theirs.

It is not an expert: it is never routed. Under tensor parallelism it splits like the dense MLP
(gate/up rows and down inputs: this rank's slice of the intermediate columns), and its partial
output joins the routed experts' before the block's one all-reduce, which therefore sums it
exactly once. Under expert parallelism it is whole on every rank and added after the experts'
reduce (or dispatch): the ranks' tokens are the same (or, across data-parallel engines, each
engine's own), so nothing needs exchanging for it. The gate (one output) is whole everywhere.

Its parameters mirror HF's names with gate/up fused, as the dense MLP's are:
shared_expert.gate_up_proj, shared_expert.down_proj (the block's `shared_expert`) and
shared_expert_gate (beside it on the block).
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.models.layer_ops import TORCH_OPS, LayerOps
from services.worker.parallel import column_range, get_tp

# A checkpoint's shared-expert tensor, relative to the block → (our parameter, shard: 0 gate,
# 1 up, None whole rows).
_SOURCES = {
    "shared_expert.gate_proj.weight": ("shared_expert.gate_up_proj.weight", 0),
    "shared_expert.up_proj.weight": ("shared_expert.gate_up_proj.weight", 1),
    "shared_expert.down_proj.weight": ("shared_expert.down_proj.weight", None),
    "shared_expert_gate.weight": ("shared_expert_gate.weight", None),
}


class SharedExpert(nn.Module):
    """down(silu(gate(x)) * up(x)) over this rank's `intermediate_size` columns of `width`
    (all of them unless `split`); no all-reduce of its own."""

    def __init__(self, hidden_size: int, width: int, split: bool) -> None:
        super().__init__()
        tp = get_tp()
        self.intermediate_start, self.intermediate_size = column_range(width, tp) if split else (0, width)
        self.partial = split and tp.size > 1  # its output is this rank's share of the sum
        self.gate_up_proj = nn.Linear(hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, hidden_size, bias=False)

    def forward(self, ops: LayerOps | None, x: torch.Tensor) -> torch.Tensor:
        ops = TORCH_OPS if ops is None else ops
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


def is_shared_expert_weight(name: str) -> bool:
    """Whether `name` (relative to the MoE block) is a shared-expert tensor."""
    return name in _SOURCES


def shared_expert_range(expert: SharedExpert, name: str) -> tuple[int, int, int] | None:
    """(dim, start, length) of this rank's columns of shared-expert tensor `name` (gate/up rows,
    down inputs; relative to the block or not); None for its gate, which every rank holds whole."""
    if "shared_expert_gate." in name:
        return None
    return (1 if "down_proj." in name else 0), expert.intermediate_start, expert.intermediate_size


def load_shared_expert(block: nn.Module, name: str, tensor: torch.Tensor) -> list[str]:
    """Copy this rank's part of shared-expert tensor `name` (relative to `block`; its columns,
    as `shared_expert_range` says) into place; returns the "param#piece" key it filled."""
    target, shard = _SOURCES[name]
    expert: SharedExpert = block.shared_expert
    if target == "shared_expert_gate.weight":
        block.shared_expert_gate.weight.copy_(tensor)
        return [f"{target}#"]
    if shard is None:  # down: this rank's inputs
        expert.down_proj.weight.copy_(tensor)
        return [f"{target}#"]
    width = expert.intermediate_size
    expert.gate_up_proj.weight.narrow(0, shard * width, width).copy_(tensor)
    return [f"{target}#{shard}"]


def shared_expert_pieces(param: str) -> tuple[str, ...] | None:
    """The pieces a checkpoint fills of shared-expert parameter `param` (relative to the block);
    None for a parameter that is not the shared expert's."""
    if param == "shared_expert.gate_up_proj.weight":
        return ("0", "1")
    if param in ("shared_expert.down_proj.weight", "shared_expert_gate.weight"):
        return ("",)
    return None
