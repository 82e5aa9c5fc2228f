"""Load a .gguf checkpoint with its block-quantized weights kept quantized (services/worker/quant).

The model is built as for an HF directory, then each layer a quantized tensor fills becomes a
QuantLinear (the embedding a QuantEmbedding) before the weights load: dense tensors (norms,
biases, F32/F16 weights) go through `loader.load_weights` as today, the raw blocks into the
quantized modules, each sliced to this rank's part. Tensor parallelism slices a column-parallel
layer's rows (any row is whole blocks) and a row-parallel layer's inputs, which must fall on
block boundaries. A MoE layer whose experts come in blocks gets a QuantExperts: each rank takes
its experts (expert parallelism) or every expert's slice of the intermediate columns (tensor
parallelism), as the dense experts split.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict

import torch
from gguf import GGMLQuantizationType

from services.worker.models.layers import DecoderForCausalLM
from services.worker.models.loader import (
    build_model,
    finish_model,
    fused_target,
    load_weights,
    needs_weight,
    rank_parts,
    tp_range,
)
from services.worker.models.moe import SparseMoeBlock
from services.worker.parallel import get_tp
from services.worker.quant import block_size, type_size
from services.worker.quant.embedding import QuantEmbedding
from services.worker.quant.experts import QuantExperts
from services.worker.quant.gguf_model import GgufCheckpoint, QuantTensor
from services.worker.models.quant_install import install_quant_modules
from services.worker.quant.weights import QuantWeights

logger = logging.getLogger(__name__)

F32 = int(GGMLQuantizationType.F32)


def load_gguf_model(path: str, dtype: torch.dtype, device: torch.device):
    """(model, config) of the .gguf file at `path`, its quantized weights kept in their blocks."""
    checkpoint = GgufCheckpoint(path)
    config = checkpoint.config
    model = build_model(config)
    replaced = install_quant_modules(model, checkpoint.quantized_names())
    model = model.to_empty(device=device)
    modules = dict(model.named_modules())
    dense, parts = [], defaultdict(dict)
    # Another stage's tensors and another rank's experts are never read from the file.
    for name, tensor in checkpoint.tensors(wanted=lambda name: needs_weight(model, name)):
        short = name.removeprefix("model.")
        expert = _expert_target(model, short)
        if expert is not None:
            block, target, shard = expert
            parts[target][shard] = _expert_part(block, short, shard, tensor, device)
            continue
        target, shard = fused_target(short)
        module = modules.get(target.removesuffix(".weight"))
        if isinstance(module, QuantWeights) and target.endswith(".weight"):
            parts[target.removesuffix(".weight")][shard] = _rank_part(model, short, tensor, device)
        else:
            dense.append((name, tensor))
    load_weights(model, rank_parts(model, dense))
    for module_name, shards in parts.items():
        module = modules[module_name]
        pieces = [shards[s] for s in sorted(shards, key=lambda s: -1 if s is None else s)]
        module.set_parts(_padded(module, pieces))
    for module in modules.values():
        if isinstance(module, (QuantEmbedding, QuantExperts)):
            module.dtype = dtype
    missing = sorted(name for name, module in modules.items() if isinstance(module, QuantWeights)
                     and name not in parts)
    if missing:
        raise KeyError(f"{path} lacks weights for: {missing[:5]}")
    held = sum(m.weight_bytes() for m in modules.values() if isinstance(m, QuantWeights))
    logger.info("loaded %s: %d layers kept quantized (%.1f MB of blocks)", path, len(replaced), held / 1e6)
    return finish_model(model, dtype, device), config


def _rank_part(model: DecoderForCausalLM, name: str, tensor: torch.Tensor | QuantTensor,
               device: torch.device) -> tuple[int, torch.Tensor]:
    """(GGUF type, rows) of this rank's part of one tensor, on `device`."""
    if not isinstance(tensor, QuantTensor):  # a dense piece of a quantized fused layer
        part = tp_range(model, name)
        if part is not None:
            dim, start, length = part
            tensor = tensor.narrow(dim, start, min(length, tensor.shape[dim] - start))
        return F32, tensor.float().to(device)
    raw, part = tensor.raw, tp_range(model, name)
    if part is not None:
        dim, start, length = part
        if dim == 0:
            raw = raw.narrow(0, start, min(length, raw.shape[0] - start))
        else:
            raw = _input_slice(raw, tensor.qtype, start, length, name)
    return tensor.qtype, raw.to(device)


# One expert's tensor in a checkpoint: layers.<i>.<block>.experts.<e>.<projection>.weight.
_EXPERT = re.compile(r"layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.weight")


def _expert_target(model: DecoderForCausalLM, name: str) -> tuple[SparseMoeBlock, str, int | None] | None:
    """(its block, our quantized module, shard: 0 gate, 1 up, None down) of one of this rank's
    experts' tensor `name` (`needs_weight` leaves the others out); None where the layer's experts
    are dense (they load as an HF checkpoint's)."""
    match = _EXPERT.fullmatch(name)
    if match is None:
        return None
    block = model.layers[int(match.group(1))].mlp
    if not isinstance(block, SparseMoeBlock) or not isinstance(block.experts, QuantExperts):
        return None
    gate, up, down = block.spec.expert_names
    if match.group(3) not in (gate, up, down):
        raise KeyError(f"unexpected weight {name!r} in checkpoint")
    local = int(match.group(2)) - block.expert_start
    prefix = f"layers.{match.group(1)}.mlp.experts"
    if match.group(3) == down:
        return block, f"{prefix}.down.{local}", None
    return block, f"{prefix}.gate_up.{local}", 0 if match.group(3) == gate else 1


def _expert_part(block: SparseMoeBlock, name: str, shard: int | None, tensor: torch.Tensor | QuantTensor,
                 device: torch.device) -> tuple[int, torch.Tensor]:
    """(GGUF type, rows) of this rank's part of one expert's tensor: the block's slice of the
    intermediate columns (gate/up rows, down inputs), all of them with one rank or whole experts."""
    start, width = block.intermediate_start, block.intermediate_size
    dense = not isinstance(tensor, QuantTensor)
    full = tensor.shape[0 if shard is not None else 1]
    if dense:
        tensor = tensor.float()
        if (start, width) != (0, full):
            tensor = tensor.narrow(0 if shard is not None else 1, start, width)
        return F32, tensor.contiguous().to(device)
    raw = tensor.raw
    if (start, width) != (0, full) and shard is not None:
        raw = raw.narrow(0, start, width)  # gate or up rows: whole blocks each
    elif (start, width) != (0, full):
        raw = _input_slice(raw, tensor.qtype, start, width, name)
    return tensor.qtype, raw.contiguous().to(device)


def _input_slice(raw: torch.Tensor, qtype: int, start: int, length: int, name: str) -> torch.Tensor:
    """Inputs [start, start + length) of raw blocks: whole blocks only."""
    block = block_size(qtype)
    if start % block or length % block:
        raise ValueError(f"{name}: tensor_parallel_size {get_tp().size} splits its inputs at {start} + {length}, "
                         f"not on its {GGMLQuantizationType(qtype).name} block boundaries ({block} weights a block); "
                         "choose a tensor_parallel_size that divides the inputs into whole blocks")
    return raw.narrow(1, start // block * type_size(qtype), length // block * type_size(qtype))


def _padded(module: QuantWeights, pieces: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
    """The last vocabulary shard's padding rows: zero bytes, which every block type reads as 0."""
    rows = sum(p[1].shape[0] for p in pieces)
    if rows >= module.out_features:
        return pieces
    qtype, last = pieces[-1]
    pad = last.new_zeros(module.out_features - rows, last.shape[1])
    return [*pieces[:-1], (qtype, torch.cat((last, pad)))]
