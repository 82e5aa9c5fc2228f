"""Mixture-of-experts feed-forward: a router picks each token's top-k experts and the experts run
as one fused layer.

- `route`: softmax over the router logits in fp32, top-k, optionally renormalised over the k
  (each architecture says whether: `MoeSpec.renormalize`).
- `moe_experts` (the op; `grouped_experts` its torch path): the (token, slot) pairs are grouped by expert and each expert's two GEMMs
  (gate/up, then down) run once on its whole group; the results, scaled by the routing
  weights, are summed back per token. On CUDA one Triton kernel per GEMM covers every expert
  (`fused_moe_triton.py`); elsewhere torch runs a GEMM pair per expert that has tokens (a loop
  over experts, never over tokens), or on CPU, once the weights are packed at load, one C call
  per layer (cpu/moe_experts.c: grouping, both GEMMs, SiLU·up and the weighted sum). Each adds
  each token's expert outputs in ascending expert order, as HF's reference does, so fp32
  results match it (the C kernel's to rounding: its GEMMs sum in another order than torch's).
- `SparseMoeBlock`: router + experts as a decoder layer's MLP. Under tensor parallelism every
  rank holds every expert's slice of the intermediate columns (like the dense MLP), or with
  expert parallelism its share of the experts whole (an id it does not hold adds nothing
  there); either way one all-reduce sums the partial outputs. The router is whole on every rank.
  With data-parallel engines as one expert-parallel group the engines' tokens differ: each
  (token, expert) pair travels to its expert's rank and back (expert_dispatch.py), every engine
  taking part in every layer's exchange, with no tokens on a dummy step.
- A shared expert (`MoeSpec.shared_expert`, Qwen2-MoE; shared_expert.py): a gated dense MLP every
  token runs beside its routed experts, added to their sum.

The experts are one opaque custom op (`myvllm::moe_experts`): torch.compile keeps the
data-dependent grouping outside its graph and compiles the rest of the layer around it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.cpu.moe_experts import CpuMoeExperts
from services.worker.models.checkpoint_parts import WHOLE, Part, part_of
from services.worker.models.expert_dispatch import dispatch_and_combine
from services.worker.models.shared_expert import (
    SharedExpert,
    is_shared_expert_weight,
    load_shared_expert,
    shared_expert_pieces,
    shared_expert_range,
)
from services.worker.parallel import (
    ExpertParallel,
    all_gather_tp,
    all_reduce,
    column_range,
    expert_range,
    get_dp,
    get_ep,
    get_tp,
)


@dataclass(frozen=True)
class MoeSpec:
    """How an architecture names and routes its experts."""

    num_experts_attr: str = "num_experts"  # config field with the expert count
    intermediate_attr: str = "moe_intermediate_size"  # config field with each expert's width
    renormalize: bool | None = None  # renormalise the top-k weights; None: config.norm_topk_prob
    fp32_weights: bool = False  # routing weights stay fp32 (Mixtral) instead of the model dtype
    checkpoint_module: str = "mlp"  # the block's name in checkpoints (Mixtral: block_sparse_moe)
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    # A gated dense MLP beside the routed experts (Qwen2-MoE), `shared_expert_intermediate_size` wide.
    shared_expert: bool = False

    def is_moe_layer(self, config, layer_idx: int) -> bool:
        """Qwen-MoE's rule (`mlp_only_layers`, `decoder_sparse_step`); every layer elsewhere."""
        if layer_idx in (getattr(config, "mlp_only_layers", None) or ()):
            return False
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return getattr(config, self.num_experts_attr) > 0 and (layer_idx + 1) % step == 0


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          weights_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → (weights [T, k] in `weights_dtype`, expert ids [T, k] int64)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
    """The torch path: x [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], weights and
    ids [T, k] → [T, H] = sum over k of weight * down(silu(gate(x)) * up(x)) of that expert.
    An id outside [0, E) (an expert another rank holds) contributes nothing."""
    num_tokens, top_k = ids.shape
    num_experts = w13.shape[0]
    flat_ids = ids.reshape(-1)
    # The (token, slot) pairs sorted by expert, stable: within an expert, in token order.
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids.clamp(-1, num_experts) + 1, minlength=num_experts + 2).tolist()
    token_of = order // top_k
    rows = x.index_select(0, token_of)
    out_rows = torch.empty_like(rows)
    lo = start = counts[0]  # ids below 0 sort first and are skipped
    for expert, n in enumerate(counts[1:num_experts + 1]):
        if n:
            gate, up = F.linear(rows[start:start + n], w13[expert]).chunk(2, dim=-1)
            out_rows[start:start + n] = F.linear(F.silu(gate) * up, w2[expert])
        start += n
    held = slice(lo, start)
    scaled = (out_rows[held] * weights.reshape(-1)[order[held], None]).to(x.dtype)
    # index_add_ adds rows in order: each token's experts in ascending order, as HF's loop does.
    return torch.zeros_like(x).index_add_(0, token_of[held], scaled)


@torch.library.custom_op("myvllm::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """`grouped_experts`, the Triton kernels on CUDA, or on CPU with `packed` weights (packed at
    load by `FusedExperts.pack_for_cpu`) the C kernel; opaque to torch.compile."""
    if packed:
        return CpuMoeExperts.load().experts(x, w13, w2, weights, ids)
    if x.is_cuda:
        from services.worker.models import fused_moe_triton

        return fused_moe_triton.fused_experts(x, w13, w2, weights, ids)
    return grouped_experts(x, w13, w2, weights, ids)


@moe_experts.register_fake
def _(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
      ids: torch.Tensor, packed: bool = False) -> torch.Tensor:
    return torch.empty_like(x)


class FusedExperts(nn.Module):
    """Every local expert's weights as two stacked tensors: w13 [E, 2I, H] (gate and up fused,
    as the dense MLP's gate_up_proj) and w2 [E, H, I]; on CPU, after `pack_for_cpu`, the C
    kernel's packed copies of them instead (cpu/moe_experts.py's layout)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.packed = False  # w13 / w2 hold the C kernel's layout

    def pack_for_cpu(self) -> bool:
        """Replace the weights by their packed copies for the C kernel (the model keeps one copy);
        False where it does not apply (not on CPU, another dtype, no AVX2, no C compiler): the
        torch path keeps running."""
        kernel = CpuMoeExperts.load() if self.w13.device.type == "cpu" else None
        if self.packed or kernel is None or not kernel.supports(self.w13):
            return False
        with torch.no_grad():
            w13, w2 = kernel.pack(self.w13, self.w2)
        self.w13, self.w2 = nn.Parameter(w13, requires_grad=False), nn.Parameter(w2, requires_grad=False)
        self.packed = True
        return True

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.packed and not torch.compiler.is_compiling():
            # eager: straight to the C kernel; the custom op's dispatch (there for torch.compile)
            # costs a third of a millisecond a call, as much as a small decode step's experts
            return CpuMoeExperts.load().experts(x, self.w13, self.w2, weights, ids)
        return moe_experts(x, self.w13, self.w2, weights, ids, self.packed)


# A checkpoint's expert tensor, relative to the block: experts.<e>.<name>.weight (HF's saved
# format) or experts.gate_up_proj / experts.down_proj (transformers' in-memory stacked format).
_EXPERT = re.compile(r"experts\.(\d+)\.(\w+)\.weight")
_STACKED = {"experts.gate_up_proj": "w13", "experts.down_proj": "w2"}


class SparseMoeBlock(nn.Module):
    """A decoder layer's MLP made of routed experts."""

    def __init__(self, config, spec: MoeSpec) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"activation {config.hidden_act!r} is not supported")
        self.spec = spec
        self.num_experts = getattr(config, spec.num_experts_attr)
        self.top_k = config.num_experts_per_tok
        self.renormalize = bool(config.norm_topk_prob) if spec.renormalize is None else spec.renormalize
        width = getattr(config, spec.intermediate_attr)
        if get_ep().size > 1:  # whole experts, this rank's share of them
            self.expert_start, self.num_local_experts = expert_range(self.num_experts, get_ep())
            self.intermediate_start, self.intermediate_size = 0, width
        else:  # every expert, this rank's slice of their columns (all of them with one rank)
            self.expert_start, self.num_local_experts = 0, self.num_experts
            self.intermediate_start, self.intermediate_size = column_range(width, get_tp())
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=False)  # the router
        # The router's row-major weight, kept by fast_paths for the CPU packed step before the
        # linear layers are packed (a oneDNN-packed router no longer holds it).
        self.router_weight: torch.Tensor | None = None
        self.experts = FusedExperts(self.num_local_experts, config.hidden_size, self.intermediate_size)
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if spec.shared_expert:  # split like the dense MLP, except under expert parallelism
            self.shared_expert = SharedExpert(config.hidden_size, config.shared_expert_intermediate_size,
                                              split=get_ep().size == 1)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        # Data-parallel engines in one group: every rank's first expert, for the dispatch.
        ep = get_ep()
        self.dispatch_starts: list[int] | None = [
            expert_range(self.num_experts, ExpertParallel(rank, ep.size))[0] for rank in range(ep.size)
        ] if get_dp().size > 1 else None
        self._starts_tensor: torch.Tensor | None = None

    def forward(self, ops: object, x: torch.Tensor) -> torch.Tensor:
        weights_dtype = torch.float32 if self.spec.fp32_weights else x.dtype
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, weights_dtype)
        if self.dispatch_starts is not None:
            return self._add_shared_expert(ops, x, self._dispatch(x, weights, ids))
        if self.num_local_experts < self.num_experts:  # local ids; another rank's experts fall outside
            ids = ids - self.expert_start
        y = self.experts(x, weights, ids)
        partial_shared = self.shared_expert is not None and self.shared_expert.partial
        if partial_shared:  # this rank's columns of it: the experts' all-reduce sums it once
            y = self._add_shared_expert(ops, x, y)
        y = all_reduce(y) if get_tp().size > 1 else y
        return y if partial_shared else self._add_shared_expert(ops, x, y)

    def _add_shared_expert(self, ops: object, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + sigmoid(shared_expert_gate(x)) * shared_expert(x), as HF adds it (y alone without
        a shared expert)."""
        if self.shared_expert is None:
            return y
        return y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(ops, x)

    def _dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This engine's tokens through the group's experts. The engine's T ranks hold the same
        tokens: each sends a contiguous 1/T share (at least one row's room, so an empty step's
        gather has something to carry) and the shares are gathered back."""
        if self._starts_tensor is None or self._starts_tensor.device != ids.device:
            self._starts_tensor = torch.tensor(self.dispatch_starts, device=ids.device)
        tp, num_tokens = get_tp(), x.shape[0]
        if tp.size == 1:
            return dispatch_and_combine(x, weights, ids, self.experts, self._starts_tensor, self.num_experts)
        share = max(-(-num_tokens // tp.size), 1)
        lo, hi = min(tp.rank * share, num_tokens), min((tp.rank + 1) * share, num_tokens)
        part = dispatch_and_combine(x[lo:hi], weights[lo:hi], ids[lo:hi], self.experts, self._starts_tensor,
                                    self.num_experts)
        padded = x.new_zeros((share, x.shape[1]))
        padded[:hi - lo] = part
        return torch.cat(all_gather_tp(padded))[:num_tokens]

    def dummy_step(self) -> None:
        """This engine has no tokens this step: take part in the layer's exchange anyway (the
        other engines' pairs may need this rank's experts)."""
        if isinstance(self.experts, FusedExperts):
            x = self.experts.w13.new_empty((0, self.experts.hidden_size))  # (the router may be packed on CPU)
        else:  # experts kept quantized (quant/experts.py)
            x = self.experts.empty_input()
        ids = torch.empty((0, self.top_k), dtype=torch.int64, device=x.device)
        self._dispatch(x, x.new_empty((0, self.top_k)), ids)

    # ------------------------------------------------------------------ loading

    def pieces(self, param: str) -> tuple[str, ...]:
        """The pieces a checkpoint fills of `param` (relative name): one per expert and shard."""
        shared = shared_expert_pieces(param)
        if shared is not None:
            return shared
        local = range(self.expert_start, self.expert_start + self.num_local_experts)
        if param == "experts.w13":
            return tuple(f"{e}.{s}" for e in local for s in (0, 1))
        if param == "experts.w2":
            return tuple(str(e) for e in local)
        return ("",)

    def holds(self, name: str) -> bool:
        """Whether this rank needs any of checkpoint tensor `name` (relative to the block): all but
        another rank's experts. Raises KeyError for a name that is not this block's."""
        if name == "gate.weight" or name in _STACKED or self._is_shared_expert(name):
            return True
        return self._local_index(self._expert_of(name)[0]) is not None

    def part(self, name: str, shape: Sequence[int]) -> Part:
        """This rank's part of checkpoint tensor `name` (relative to the block, one it `holds`) of
        `shape`: its experts of a stacked tensor and its slice of their intermediate columns (all
        of them with one rank or under expert parallelism), the shared expert's columns, the
        router whole."""
        if name == "gate.weight":
            return WHOLE
        if self._is_shared_expert(name):
            piece = shared_expert_range(self.shared_expert, name)
            return WHOLE if piece is None else part_of(shape, {piece[0]: piece[1:]})
        experts, columns = (self.expert_start, self.num_local_experts), (self.intermediate_start, self.intermediate_size)
        if name == "experts.down_proj":  # [E, H, I]
            return part_of(shape, {0: experts, 2: columns})
        if name == "experts.gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            # One box cannot leave out the rows between the gate's slice and the up's: it spans
            # from the first's start to the second's end (every row but under tensor parallelism).
            start, width = columns
            return part_of(shape, {0: experts, 1: (start, shape[1] // 2 + width)})
        which = self._expert_of(name)[1]
        return part_of(shape, {1 if which == self.spec.expert_names[2] else 0: columns})

    def load(self, name: str, tensor: torch.Tensor) -> list[str]:
        """Copy this rank's `part` of checkpoint tensor `name` (relative to the block) into place;
        returns the "param#piece" keys it filled (none for another rank's expert). Raises KeyError
        for a name that is not this block's."""
        if name == "gate.weight":
            self.gate.weight.copy_(tensor)
            return ["gate.weight#"]
        if name in _STACKED:
            return self._load_stacked(_STACKED[name], tensor)
        if self._is_shared_expert(name):
            return load_shared_expert(self, name, tensor)
        expert, which = self._expert_of(name)
        local = self._local_index(expert)
        if local is None:
            return []  # another rank's expert
        gate_name, _, down_name = self.spec.expert_names
        if which == down_name:
            self.experts.w2[local].copy_(tensor)
            return [f"experts.w2#{expert}"]
        shard, width = (0 if which == gate_name else 1), self.intermediate_size
        self.experts.w13[local].narrow(0, shard * width, width).copy_(tensor)
        return [f"experts.w13#{expert}.{shard}"]

    def _is_shared_expert(self, name: str) -> bool:
        return self.shared_expert is not None and is_shared_expert_weight(name)

    def _expert_of(self, name: str) -> tuple[int, str]:
        """(expert, projection) of one expert's checkpoint tensor; KeyError for any other name."""
        match = _EXPERT.fullmatch(name)
        if match is None or match.group(2) not in self.spec.expert_names or int(match.group(1)) >= self.num_experts:
            raise KeyError(f"unexpected weight {name!r} in checkpoint")
        return int(match.group(1)), match.group(2)

    def _local_index(self, expert: int) -> int | None:
        """Expert `expert`'s index among this rank's experts; None for another rank's."""
        local = expert - self.expert_start
        return local if 0 <= local < self.num_local_experts else None

    def _load_stacked(self, param: str, tensor: torch.Tensor) -> list[str]:
        """This rank's `part` of a stacked tensor: its experts, and its columns of them (w13's
        gate rows first in it, its up rows last)."""
        if param == "w2":  # [E, H, I]
            self.experts.w2.copy_(tensor)
            return [f"experts.w2#{key}" for key in self.pieces("experts.w2")]
        width = self.intermediate_size  # [E, 2I, H] part
        for shard, first in ((0, 0), (1, tensor.shape[1] - width)):
            self.experts.w13.narrow(1, shard * width, width).copy_(tensor.narrow(1, first, width))
        return [f"experts.w13#{key}" for key in self.pieces("experts.w13")]
