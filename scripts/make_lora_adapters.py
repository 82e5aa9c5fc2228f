"""Random LoRA adapters in PEFT's format for a model directory (tests, benchmarks, trying LoRA):

    python scripts/make_lora_adapters.py MODEL_DIR OUT_DIR [--num 4] [--seed 0] [--rank R] [--targets ...]

Each adapter gets its own rank, target modules and scaling (services/entrypoints/bench/lora_adapters.py)
unless --rank / --targets fix them; prints the adapters' directories.
"""

from __future__ import annotations

import argparse

from services.entrypoints.bench.lora_adapters import write_random_adapters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--num", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=None, help="one rank for every adapter")
    parser.add_argument("--targets", nargs="+", default=None, help="one set of target modules for every adapter")
    args = parser.parse_args()
    for path in write_random_adapters(args.model_dir, args.out_dir, args.num, args.seed, args.rank,
                                      tuple(args.targets) if args.targets else None):
        print(path)


if __name__ == "__main__":
    main()
