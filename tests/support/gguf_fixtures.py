"""Tiny GGUF checkpoints for the quantized-weights tests: a tiny HF model's weights quantized
with gguf-py and written with GGUFWriter, beside an HF directory holding exactly the
dequantized weights (so the two must compute the same)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

# HF names (per layer) → llama.cpp names.
_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
# Which block type each projection gets: a mix, v differing from q/k (a fused layer of two types).
_QTYPES = {"attn_q": GGMLQuantizationType.Q8_0, "attn_k": GGMLQuantizationType.Q8_0,
           "attn_v": GGMLQuantizationType.Q4_0, "attn_output": GGMLQuantizationType.Q4_1,
           "ffn_gate": GGMLQuantizationType.Q4_0, "ffn_up": GGMLQuantizationType.Q4_0,
           "ffn_down": GGMLQuantizationType.Q8_0, "token_embd": GGMLQuantizationType.Q8_0,
           "output": GGMLQuantizationType.Q8_0}


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
    """(path of the .gguf, HF directory of its dequantized weights) for tiny `hf_dir` (qwen2/qwen3:
    llama.cpp leaves their q/k rows unpermuted). `qtypes`: block type per llama.cpp tensor kind
    (default: a mix, v differing from q/k)."""
    qtypes = _QTYPES if qtypes is None else qtypes
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    weights = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        weights.update(load_file(str(f)))
    gguf_path = out / f"tiny-{arch}.gguf"
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
    dense = {}
    for name, tensor in weights.items():
        gname = _gguf_name(name)
        data = tensor.float().numpy()
        qtype = qtypes.get(gname.split(".")[-2]) if data.ndim == 2 else None
        if qtype is None:
            writer.add_tensor(gname, data)
            dense[name] = tensor.float()
            continue
        raw = quantize(data, qtype)
        writer.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=qtype)
        dense[name] = torch.from_numpy(dequantize(raw, qtype).copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    hf_out = out / f"tiny-{arch}-dequantized"
    hf_out.mkdir()
    save_file(dense, str(hf_out / "model.safetensors"))
    for f in Path(hf_dir).iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, hf_out / f.name)
    return str(gguf_path), str(hf_out)


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
