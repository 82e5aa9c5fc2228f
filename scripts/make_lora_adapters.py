"""Tiny random LoRA adapters in PEFT's format for a model directory (tests and benchmarks).

PEFT initialises lora_B to zeros (an adapter that changes nothing); here both A and B are random,
scaled so that the adapter moves the model's outputs clearly without drowning the base model.
Each adapter gets its own rank and target modules (cycled from ADAPTER_SHAPES) unless given.

    python scripts/make_lora_adapters.py MODEL_DIR OUT_DIR [--num 4] [--seed 0] [--rank R] [--targets ...]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

# (rank, alpha, target modules, rsLoRA) per adapter, cycled: different ranks, subsets and scalings.
ADAPTER_SHAPES = [
    (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    (4, 8, ["q_proj", "v_proj"], False),
    (16, 16, ["o_proj", "down_proj", "up_proj"], True),
    (2, 4, ["k_proj", "gate_proj"], False),
]


def make_adapters(model_dir: str, out_dir: str, num: int = 4, seed: int = 0, rank: int | None = None,
                  targets: list[str] | None = None, magnitude: float = 0.5) -> list[str]:
    """Write `num` adapters under out_dir/lora-{i}; returns their paths."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(num):
        r, alpha, modules, rslora = ADAPTER_SHAPES[i % len(ADAPTER_SHAPES)]
        r, modules = rank or r, targets or modules
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=modules, use_rslora=rslora,
                                                lora_dropout=0.0))
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_A" in name or "lora_B" in name:
                    fan_in = param.shape[1]
                    param.copy_(torch.randn(param.shape, generator=gen) * magnitude / fan_in ** 0.5)
        path = Path(out_dir) / f"lora-{i}"
        model.save_pretrained(str(path))
        os.chmod(path, 0o755)
        paths.append(str(path))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--num", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=None, help="one rank for every adapter")
    parser.add_argument("--targets", nargs="+", default=None, help="one set of target modules for every adapter")
    args = parser.parse_args()
    for path in make_adapters(args.model_dir, args.out_dir, args.num, args.seed, args.rank, args.targets):
        print(path)


if __name__ == "__main__":
    main()
