"""`myvllm`: the command line. Each subcommand's work lives in its own module."""

from __future__ import annotations

import argparse
import os
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine arguments, with vLLM's flag names."""
    p.add_argument("--model", default=None, help="HF model directory (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (default): bfloat16 on a CPU with bf16 instructions (avx512_bf16 / AMX), "
                        "float32 on other CPUs, bfloat16 on CUDA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--kv-cache-memory", dest="kv_cache_memory_bytes", type=int, default=None,
                   help="KV cache budget in bytes")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--attention-backend", default=None, choices=["torch", "cpu", "triton"],
                   help="default: triton on CUDA, cpu (C decode kernel) on CPU")
    p.add_argument("--async-scheduling", dest="async_scheduling", action="store_true", default=None,
                   help="keep two steps in flight (default: on for CUDA, off on CPU)")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
    p.add_argument("--compile", dest="compile_model", action="store_true",
                   help="CPU: compile the model's forward with torch.compile (inductor; opt-in: the first start "
                        "compiles for minutes; see BENCHMARKS.md)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    keys = ("model", "dtype", "seed", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
            "enable_prefix_caching", "num_gpu_blocks_override", "kv_cache_memory_bytes", "scheduling_policy",
            "attention_backend", "async_scheduling", "compile_model")
    return {k: getattr(args, k) for k in keys if hasattr(args, k)}


def _cmd_generate(args: argparse.Namespace) -> int:
    from services.sdk import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], sp, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, sp, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="myvllm", description="my-vllm: a vLLM-architecture LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt offline with the in-process engine")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    _add_engine_args(g)
    g.set_defaults(func=_cmd_generate)

    from services import launcher

    launcher.add_subcommands(sub, _add_engine_args)

    from services.bench import cli as bench_cli

    bench_cli.add_subcommand(sub, _add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # no "Got goaway" chatter when a peer restarts
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
