"""Write a random mixture-of-experts checkpoint (HF safetensors + config + the default model's
tokenizer) for benchmarks: no model hub here, so MoE speed is measured on random weights of a
real architecture's shape.

    python scripts/make_moe_checkpoint.py --shape tiny   --out models/moe-tiny
    python scripts/make_moe_checkpoint.py --shape a3b-16 --out models/moe-a3b-16

Shapes (Qwen3-MoE, `Qwen3MoeForCausalLM`):
- tiny:   8 experts, top-2, 4 layers, hidden 256 (the issue's small case);
- a3b-16: Qwen3-30B-A3B's proportions scaled to run on a 2-core CPU: 64 experts, top-8 (as
          A3B), expert width 192, hidden 512, 8 heads / 2 KV heads of 64, 8 layers (A3B: 128
          experts, top-8, expert width 768, hidden 2048, 32 / 4 heads of 128, 48 layers).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3MoeConfig

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_SOURCE = REPO / "models" / "SmolLM2-135M-Instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt")

SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=256),
    "a3b-16": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=64, num_experts=64, num_experts_per_tok=8,
                   moe_intermediate_size=192),
}


def write_checkpoint(shape: str, out: Path, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**SHAPES[shape], vocab_size=49152, max_position_embeddings=4096, rms_norm_eps=1e-6,
                            rope_theta=1000000.0, norm_topk_prob=True, tie_word_embeddings=False,
                            bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.05)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.2)  # a router that spreads tokens over the experts
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        if (TOKENIZER_SOURCE / name).is_file():
            shutil.copy2(TOKENIZER_SOURCE / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_checkpoint(args.shape, args.out, args.seed))


if __name__ == "__main__":
    main()
