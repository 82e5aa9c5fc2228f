"""Random LoRA adapters in PEFT's on-disk format for a model directory (benchmarks and tests):
`adapter_config.json` + `adapter_model.safetensors` with PEFT's tensor names, A and B both random
(PEFT's own initialisation leaves B zero: an adapter that changes nothing), scaled so that an
adapter moves the model's outputs clearly without drowning it. Written directly from the model's
config.json, so no PEFT is needed to make them (PEFT reads them: the LoRA tests' oracle)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.common.lora_adapter_config import CONFIG_FILE, WEIGHTS_FILE

# (rank, alpha, target modules, rsLoRA) per adapter, cycled: different ranks, subsets and scalings.
ADAPTER_SHAPES = [
    (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), False),
    (4, 8, ("q_proj", "v_proj"), False),
    (16, 16, ("o_proj", "down_proj", "up_proj"), True),
    (2, 4, ("k_proj", "gate_proj"), False),
]
ALL_MODULES = ADAPTER_SHAPES[0][2]


def module_widths(model_dir: str) -> tuple[int, dict[str, tuple[int, int]]]:
    """The model's layer count and each adaptable projection's (in, out) widths."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    q, kv = heads * head_dim, int(config.get("num_key_value_heads", heads)) * head_dim
    inter = int(config["intermediate_size"])
    return int(config["num_hidden_layers"]), {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def write_random_adapters(model_dir: str, out_dir: str, num: int, seed: int = 0, rank: int | None = None,
                          targets: tuple[str, ...] | None = None, magnitude: float = 0.5) -> list[str]:
    """`num` adapters under out_dir/lora-{i} (shapes cycled from ADAPTER_SHAPES unless `rank` /
    `targets` fix them); returns their paths."""
    num_layers, widths = module_widths(model_dir)
    paths = []
    for i in range(num):
        r, alpha, modules, rslora = ADAPTER_SHAPES[i % len(ADAPTER_SHAPES)]
        r, modules = rank or r, tuple(targets or modules)
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        tensors = {}
        for layer in range(num_layers):
            for module in modules:
                in_features, out_features = widths[module]
                part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                name = f"base_model.model.model.layers.{layer}.{part}.{module}"
                tensors[f"{name}.lora_A.weight"] = torch.randn(r, in_features, generator=gen) * (
                    magnitude / in_features ** 0.5)
                tensors[f"{name}.lora_B.weight"] = torch.randn(out_features, r, generator=gen) * (
                    magnitude / r ** 0.5)
        path = Path(out_dir) / f"lora-{i}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / WEIGHTS_FILE))
        (path / CONFIG_FILE).write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
            "target_modules": list(modules), "use_rslora": rslora, "lora_dropout": 0.0, "bias": "none",
            "base_model_name_or_path": os.path.abspath(model_dir)}, indent=1))
        paths.append(str(path))
    return paths
