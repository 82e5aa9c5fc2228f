"""Swap a built model's linear layers, embedding and MoE experts for quantized ones: empty,
before a GGUF's blocks load, or made from the loaded weights (`--quantization int8`, linear
layers only)."""

from __future__ import annotations

import logging

import torch
from gguf import GGMLQuantizationType
from torch import nn

from services.worker.models.layers import DecoderForCausalLM, RowParallelLinear
from services.worker.models.moe import SparseMoeBlock
from services.worker.quant import block_size
from services.worker.quant.embedding import QuantEmbedding
from services.worker.quant.experts import QuantExperts
from services.worker.quant.int8 import quantize_q8_0
from services.worker.quant.linear import QuantLinear

logger = logging.getLogger(__name__)

Q8_0 = int(GGMLQuantizationType.Q8_0)

# Our fused layers and the checkpoint names that fill them.
_FUSED_SOURCES = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
    "mlp.shared_expert.gate_up_proj": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
    "mlp.shared_expert.down_proj": ("mlp.shared_expert.down_proj",),
}


def quant_linear_like(linear: nn.Linear) -> QuantLinear:
    """An empty QuantLinear of `linear`'s shape, bias and parallel kind."""
    return QuantLinear(linear.in_features, linear.out_features, linear.bias is not None,
                       row_parallel=isinstance(linear, RowParallelLinear))


def install_quant_modules(model: DecoderForCausalLM, quantized: set[str]) -> list[str]:
    """Replace each of `model`'s layers that a quantized checkpoint tensor fills (HF names in
    `quantized`, e.g. "model.layers.0.self_attn.q_proj.weight") by an empty quantized one;
    returns the replaced modules' names."""
    names = {n.removeprefix("model.").removesuffix(".weight") for n in quantized}
    replaced = []
    for i in model.layer_range:
        layer = model.layers[i]
        for ours, sources in _FUSED_SOURCES.items():
            if any(f"layers.{i}.{source}" in names for source in sources):
                parent_name, child = ours.rsplit(".", 1)
                parent = _submodule(layer, parent_name)
                if not isinstance(getattr(parent, child, None), nn.Linear):
                    continue  # an MoE block's experts: not handled here
                setattr(parent, child, quant_linear_like(getattr(parent, child)))
                replaced.append(f"layers.{i}.{ours}")
        if isinstance(layer.mlp, SparseMoeBlock) and _has_quantized_experts(layer.mlp, i, names):
            block = layer.mlp
            block.experts = QuantExperts(block.num_local_experts, model.config.hidden_size, block.intermediate_size)
            replaced.append(f"layers.{i}.mlp.experts")
    if model.embed_tokens is not None and "embed_tokens" in names:
        model.embed_tokens = QuantEmbedding(model.config.vocab_size, model.config.hidden_size)
        replaced.append("embed_tokens")
    if getattr(model, "lm_head", None) is not None and "lm_head" in names:
        model.lm_head = quant_linear_like(model.lm_head)
        replaced.append("lm_head")
    return replaced


def _submodule(layer: nn.Module, name: str) -> nn.Module | None:
    """layer.<name> (dotted), None where the layer has no such module (e.g. a dense layer's
    shared expert)."""
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None


def _has_quantized_experts(block: SparseMoeBlock, layer: int, names: set[str]) -> bool:
    """Whether any expert of MoE layer `layer` comes in blocks (then all its experts stay
    quantized, a dense one held as a dense part)."""
    prefixes = tuple(f"layers.{layer}.{module}.experts." for module in ("mlp", block.spec.checkpoint_module))
    return any(name.startswith(prefixes) for name in names)


@torch.no_grad()
def quantize_linears_int8(model: nn.Module) -> int:
    """Replace every decoder-layer nn.Linear of `model` (loaded weights) whose input size is a
    whole number of 32-weight blocks by a Q8_0 QuantLinear; the LM head and embedding stay dense
    (they set the logits' precision). Returns how many were replaced."""
    swaps = [(parent, name, child) for parent in model.layers.modules() for name, child in parent.named_children()
             if isinstance(child, nn.Linear)]
    kept = 0
    for parent, name, child in swaps:
        if child.in_features % block_size(Q8_0):
            kept += 1
            continue
        quant = quant_linear_like(child).to(child.weight.device)
        quant.set_parts([(Q8_0, quantize_q8_0(child.weight))])
        if child.bias is not None:
            quant.bias.copy_(child.bias)
        setattr(parent, name, quant)
    if kept:
        logger.warning("--quantization int8: %d linear layers stay dense (inputs not a multiple of %d)",
                       kept, block_size(Q8_0))
    return len(swaps) - kept
