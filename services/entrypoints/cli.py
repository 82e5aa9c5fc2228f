"""`myvllm`: the command line. Each subcommand's work lives in its own module."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from services.entrypoints.arg_parser import CommandParser
from services.entrypoints.engine_args import add_engine_args, engine_kwargs
from services.entrypoints.vllm_compat import add_vllm_compat_args, model_of


def _cmd_generate(args: argparse.Namespace) -> int:
    from services.offline import LLM, SamplingParams

    try:
        llm = LLM(**{**engine_kwargs(args), "model": model_of(args)})
    except (ValueError, FileNotFoundError) as e:  # a bad flag combination or model path: say so, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed)
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], sp, use_tqdm=False)
        else:
            out = llm.generate(args.prompt, sp, use_tqdm=False)
        print(out[0].outputs[0].text)
    finally:
        llm.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="myvllm", description="my-vllm: a vLLM-architecture LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt offline with the in-process engine")
    g.add_argument("--prompt", required=True, help="the prompt to complete")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="the request's own random seed (default: none, the engine's --seed)")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    add_engine_args(g)
    add_vllm_compat_args(g)
    g.set_defaults(func=_cmd_generate)

    from services.entrypoints import launcher

    launcher.add_subcommands(sub)

    from services.entrypoints.bench import cli as bench_cli

    bench_cli.add_subcommand(sub, add_engine_args)

    from services.entrypoints.deploy import cli as deploy_cli

    deploy_cli.add_subcommand(sub)
    return parser


def _sigterm_as_ctrl_c(signum: int, frame) -> None:
    """SIGTERM does whatever Ctrl-C does at that moment (asyncio.run cancels its main task on the
    first, raises KeyboardInterrupt on the second; ignored once a command is already stopping)."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)


def install_stop_signals() -> None:
    """Ctrl-C (SIGINT) and SIGTERM both stop a command the way Ctrl-C does in a terminal,
    whatever this process inherited: a background job of a non-interactive shell (CI runners,
    `nohup`, `make -j`) starts with SIGINT ignored, and Python then installs no
    KeyboardInterrupt of its own. `serve` and the gateway put their own handlers on top.

    Only inherited dispositions (default or ignored) are replaced: a program that calls `main()`
    in-process with handlers of its own (a test runner that cleans up on SIGTERM) keeps them."""
    for signum, handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, _sigterm_as_ctrl_c)):
        if signal.getsignal(signum) in (signal.SIG_DFL, signal.SIG_IGN, None):
            signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> int:
    install_stop_signals()
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # no "Got goaway" chatter when a peer restarts
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:  # stopped before the command had its own handling in place
        return 130


if __name__ == "__main__":
    sys.exit(main())
