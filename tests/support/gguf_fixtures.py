"""Tiny GGUF checkpoints for the quantized-weights tests: a tiny HF model's weights quantized
with gguf-py and written with GGUFWriter, beside an HF directory holding exactly the
dequantized weights (so the two must compute the same). Mixture-of-experts checkpoints
(qwen3_moe, qwen2_moe with its shared expert, mixtral) are written as llama.cpp writes them: each
projection's experts stacked into one 3-D tensor, the router as ffn_gate_inp."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

# HF names (per layer) → llama.cpp names.
_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# An expert's projection (Qwen-MoE's names, then Mixtral's) → the llama.cpp tensor of all experts.
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
            "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
_EXPERT_NAME = re.compile(r"model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.weight")
# The GGUF architecture of each tiny HF model (Mixtral's files say llama).
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "mixtral": "llama",
              "qwen2_moe": "qwen2moe"}
# Which block type each projection gets: a mix, v differing from q/k (a fused layer of two types).
_QTYPES = {"attn_q": GGMLQuantizationType.Q8_0, "attn_k": GGMLQuantizationType.Q8_0,
           "attn_v": GGMLQuantizationType.Q4_0, "attn_output": GGMLQuantizationType.Q4_1,
           "ffn_gate": GGMLQuantizationType.Q4_0, "ffn_up": GGMLQuantizationType.Q4_0,
           "ffn_down": GGMLQuantizationType.Q8_0, "token_embd": GGMLQuantizationType.Q8_0,
           "output": GGMLQuantizationType.Q8_0,
           # Experts: gate and up of two types (a fused gate_up of two parts), down a third.
           "ffn_gate_exps": GGMLQuantizationType.Q4_0, "ffn_up_exps": GGMLQuantizationType.Q4_1,
           "ffn_down_exps": GGMLQuantizationType.Q8_0,
           # A shared expert (qwen2moe) as llama.cpp quantizes it, like a dense MLP; its gate stays F32.
           "ffn_gate_shexp": GGMLQuantizationType.Q4_0, "ffn_up_shexp": GGMLQuantizationType.Q4_1,
           "ffn_down_shexp": GGMLQuantizationType.Q8_0}


def _gguf_name(hf: str) -> str:
    hf = hf.removeprefix("model.")
    if hf.startswith("layers."):
        _, index, rest = hf.split(".", 2)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{index}.{_BLOCK[module]}.{kind}"
    return {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


# One block type per fused projection (q/k/v alike, gate/up alike): what the C decode step takes.
UNIFORM_QTYPES = {"attn_q": GGMLQuantizationType.Q4_1, "attn_k": GGMLQuantizationType.Q4_1,
                  "attn_v": GGMLQuantizationType.Q4_1, "attn_output": GGMLQuantizationType.Q8_0,
                  "ffn_gate": GGMLQuantizationType.Q4_0, "ffn_up": GGMLQuantizationType.Q4_0,
                  "ffn_down": GGMLQuantizationType.Q4_1, "token_embd": GGMLQuantizationType.Q8_0,
                  "output": GGMLQuantizationType.Q4_0}


def write_quantized_pair(hf_dir: str, arch: str, out: Path,
                         qtypes: dict[str, GGMLQuantizationType] | None = None) -> tuple[str, str]:
    """(path of the .gguf, HF directory of its dequantized weights) for tiny `hf_dir`, written as
    GGUF architecture `arch` (GGUF_ARCHS; llama's q/k rows permuted as llama.cpp's converter
    does). `qtypes`: block type per llama.cpp tensor kind (default: a mix, v differing from q/k);
    a tensor whose rows are not whole blocks of its type stays F32 (Mixtral's 48-wide experts' down)."""
    qtypes = _QTYPES if qtypes is None else qtypes
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    weights = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        weights.update(load_file(str(f)))
    model_type = config["model_type"]
    gguf_path = out / f"tiny-{model_type}.gguf"
    writer = GGUFWriter(str(gguf_path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"] if "rope_theta" in config else
                              config["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if "shared_expert_intermediate_size" in config:
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    dense = {}
    for gname, (data, hf_names) in _gguf_tensors(weights).items():
        qtype = qtypes.get(gname.split(".")[-2]) if data.ndim >= 2 else None
        if qtype is not None and data.shape[-1] % GGML_QUANT_SIZES[qtype][0]:
            qtype = None
        raw = data if qtype is None else quantize(data, qtype)
        weight = data if qtype is None else dequantize(raw, qtype)
        if arch == "llama" and gname.split(".")[-2] in ("attn_q", "attn_k"):
            heads = config["num_attention_heads" if gname.split(".")[-2] == "attn_q" else "num_key_value_heads"]
            raw = _permute_rows(raw, heads)
        if qtype is None:
            writer.add_tensor(gname, raw)
        else:
            writer.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=qtype)
        if data.ndim == 3:  # experts: one HF tensor each
            dense.update({name: torch.from_numpy(weight[e].copy()) for e, name in enumerate(hf_names)})
        else:
            dense[hf_names[0]] = torch.from_numpy(np.array(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    hf_out = out / f"tiny-{model_type}-dequantized"
    hf_out.mkdir()
    save_file(dense, str(hf_out / "model.safetensors"))
    for f in Path(hf_dir).iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, hf_out / f.name)
    return str(gguf_path), str(hf_out)


def _gguf_tensors(weights: dict[str, torch.Tensor]) -> dict[str, tuple[np.ndarray, list[str]]]:
    """llama.cpp name → (fp32 data, the HF names it holds): each projection's experts stacked
    [n_expert, rows, cols] in expert order, every other tensor as it is."""
    tensors: dict[str, tuple[np.ndarray, list[str]]] = {}
    experts: dict[str, dict[int, tuple[np.ndarray, str]]] = {}
    for name, tensor in weights.items():
        match = _EXPERT_NAME.fullmatch(name)
        if match is None:
            tensors[_gguf_name(name)] = (tensor.float().numpy(), [name])
            continue
        layer, expert, projection = match.groups()
        experts.setdefault(f"blk.{layer}.{_EXPERTS[projection]}.weight", {})[int(expert)] = (tensor.float().numpy(),
                                                                                             name)
    for gname, by_expert in experts.items():
        ordered = [by_expert[e] for e in sorted(by_expert)]
        tensors[gname] = (np.stack([data for data, _ in ordered]), [name for _, name in ordered])
    return tensors


def _permute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (each head's rotary pairs adjacent) from HF's (halves)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def random_k_blocks(qtype: GGMLQuantizationType, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """Random bytes of a K-quant type (gguf-py cannot quantize to them) with finite, modest fp16
    super-block scales."""
    from gguf import GGML_QUANT_SIZES

    rng = np.random.default_rng(seed)
    size = GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, size), dtype=np.uint8)
    scales = (0.01 * rng.standard_normal((raw.shape[0], 2))).astype(np.float16).view(np.uint8)
    if qtype == GGMLQuantizationType.Q6_K:
        raw[:, -2:] = scales[:, :2]
    else:  # Q4_K / Q5_K: d and dmin first
        raw[:, :4] = scales
    return raw.reshape(rows, blocks_per_row * size)
