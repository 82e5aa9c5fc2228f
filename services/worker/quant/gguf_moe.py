"""The mixture-of-experts side of a .gguf file: which families have one, the config fields
transformers' GGUF mapping leaves out, and the HF names of the router and expert tensors.

llama.cpp stores a layer's experts as three 3-D tensors, blk.N.ffn_{gate,up,down}_exps
([n_expert, rows, cols], each row quantized on its own), and its router as blk.N.ffn_gate_inp.
Mixtral files say "llama" with an expert count; Qwen-MoE files say qwen3moe / qwen2moe, the
latter with a shared expert (ffn_*_shexp, gated by ffn_gate_inp_shexp).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gguf import GGUFReader

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MOE_ARCHS = ("qwen3moe", "qwen2moe")
# Gate, up and down: the order of MoeSpec.expert_names.
EXPERT_KINDS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
ROUTER_KIND = "ffn_gate_inp"
# llama.cpp names of a shared expert (Qwen2-MoE) → HF names inside the layer's `mlp`.
SHARED_EXPERT_NAMES = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}


@dataclass(frozen=True)
class MoeNames:
    """How an HF checkpoint of the family names a MoE block and its experts."""

    module: str  # the block (Mixtral: block_sparse_moe)
    experts: tuple[str, str, str]  # each expert's gate, up and down projections

    def router(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.module}.gate.weight"

    def expert(self, layer: int, expert: int, kind: str) -> str:
        """The HF name of one expert's slice of llama.cpp tensor kind `kind` (EXPERT_KINDS)."""
        return f"model.layers.{layer}.{self.module}.experts.{expert}.{self.experts[EXPERT_KINDS.index(kind)]}.weight"


QWEN_MOE_NAMES = MoeNames("mlp", ("gate_proj", "up_proj", "down_proj"))
MIXTRAL_NAMES = MoeNames("block_sparse_moe", ("w1", "w3", "w2"))


def _field(reader: GGUFReader, key: str) -> int | None:
    field = reader.fields.get(key)
    return None if field is None else int(field.contents())


def expert_layers(reader: GGUFReader) -> set[int]:
    """The layers whose feed-forward is routed experts (they have a router)."""
    found = (re.fullmatch(rf"blk\.(\d+)\.{ROUTER_KIND}\.weight", t.name) for t in reader.tensors)
    return {int(m.group(1)) for m in found if m is not None}


def moe_names(architecture: str, reader: GGUFReader) -> MoeNames | None:
    """The naming of this file's MoE blocks (None: a dense model)."""
    if architecture in MOE_ARCHS:
        return QWEN_MOE_NAMES
    if architecture == "llama" and (_field(reader, "llama.expert_count") or 0) > 0:
        return MIXTRAL_NAMES
    return None


def moe_config(config: PretrainedConfig, architecture: str, reader: GGUFReader) -> PretrainedConfig:
    """`config` (transformers' mapping of the file's metadata) completed for a MoE file: the
    experts' width and which layers have experts (Qwen-MoE), or a Mixtral config for a llama
    file with experts. A dense model's config is returned as it is."""
    names = moe_names(architecture, reader)
    if names is None:
        return config
    layers = expert_layers(reader)
    if names is MIXTRAL_NAMES:
        from transformers import MixtralConfig

        if layers != set(range(config.num_hidden_layers)):
            raise NotImplementedError("a llama GGUF with experts in only some layers is not supported "
                                      f"(experts in layers {sorted(layers)})")
        fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        return MixtralConfig(**{**fields, "num_local_experts": _field(reader, "llama.expert_count"),
                                "num_experts_per_tok": _field(reader, "llama.expert_used_count"),
                                "sliding_window": None})
    width = _field(reader, f"{architecture}.expert_feed_forward_length")
    if width is not None:
        config.moe_intermediate_size = width
    shared = _field(reader, f"{architecture}.expert_shared_feed_forward_length")
    if shared is not None:
        config.shared_expert_intermediate_size = shared
    # llama.cpp finds each layer's experts by its tensors; say the same to the model.
    config.decoder_sparse_step = 1
    config.mlp_only_layers = sorted(set(range(config.num_hidden_layers)) - layers)
    return config
