"""vLLM's `serve` flags that have no feature of their own here, in one place, so that a vLLM user's
command line is either taken or refused with the reason, never `unrecognized arguments`:

- REFUSED: flags whose feature my-vllm lacks (yet): exit 2 with one line naming the flag and why;
- LIMITED: flags taken with the values that describe what my-vllm does, any other value refused
  the same way;
- accepted flags that change nothing here (`--enable-chunked-prefill`: always on;
  `--trust-remote-code`: no model code ever runs), the second logged;
- where the model comes from: `--revision` and `--download-dir` look a MODEL that is not a
  directory up in the local Hugging Face cache (services/entrypoints/model_source.py).

`serve` and `generate` take them (the commands a vLLM user types); the services they start get
the resolved model directory instead.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.common.config import check_model_dir, default_model_path
from services.entrypoints.arg_parser import CommandParser
from services.entrypoints.model_source import resolve_model

logger = logging.getLogger("myvllm.flags")



@dataclass(frozen=True)
class RefusedFlag:
    options: tuple[str, ...]  # the flag and its aliases, vLLM's spelling
    reason: str
    nargs: int | str | None = None  # what vLLM's flag takes (argparse's nargs; 0: a switch)
    metavar: str | None = None


REFUSED = (
    RefusedFlag(("--no-enable-chunked-prefill",), "chunked prefill is always on here: a prompt longer than "
                "--max-num-batched-tokens is computed in chunks of it", nargs=0),
)


@dataclass(frozen=True)
class LimitedFlag:
    option: str
    allowed: tuple[str, ...]  # the first is the default
    reason: str  # why other values are refused
    help: str


LIMITED = (
    LimitedFlag("--kv-cache-dtype", ("auto",), "not supported yet: the KV cache is kept in the model's dtype",
                "the KV cache's dtype: auto, the model's (the only one supported yet)"),
    LimitedFlag("--load-format", ("auto", "safetensors", "gguf"), "my-vllm loads safetensors checkpoints and "
                ".gguf files only", "how weights are read: auto, safetensors, or gguf (a .gguf model file, "
                "which auto reads as gguf too)"),
)


class _Refuse(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, reason: str = "", **kwargs: Any) -> None:
        self.reason = reason
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        _refuse(parser, option_string or self.option_strings[0], self.reason)


class _OneOf(argparse.Action):
    """Stores a value among `allowed`; another is refused naming the reason (argparse's own
    `choices` would only list the values)."""

    def __init__(self, option_strings: Sequence[str], dest: str, allowed: Sequence[str] = (), reason: str = "",
                 **kwargs: Any) -> None:
        self.allowed, self.reason = tuple(allowed), reason
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if values not in self.allowed:
            _refuse(parser, option_string or self.option_strings[0],
                    f"{values} is refused: {self.reason} (accepted: {', '.join(self.allowed)})")
        setattr(namespace, self.dest, values)


def _refuse(parser: argparse.ArgumentParser, option: str, reason: str) -> None:
    if isinstance(parser, CommandParser):
        parser.refuse(option, reason)
    parser.error(f"argument {option}: {reason}")


def add_vllm_compat_args(p: CommandParser) -> None:
    """The flags of this module's table (serve's and generate's)."""
    for flag in REFUSED:
        p.add_argument(*flag.options, action=_Refuse, reason=flag.reason, nargs=flag.nargs, metavar=flag.metavar,
                       default=argparse.SUPPRESS, help=f"refused: {flag.reason}")
    for limited in LIMITED:
        p.add_argument(limited.option, action=_OneOf, allowed=limited.allowed, reason=limited.reason,
                       default=limited.allowed[0], help=limited.help)
    p.add_argument("--enable-chunked-prefill", action="store_true", default=True,
                   help="accepted: chunked prefill is always on (the default; --no-enable-chunked-prefill is refused)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted with no effect: my-vllm never runs code from a model's repository (its "
                        "architectures are built in)")
    p.add_argument("--revision", default=None,
                   help="with a MODEL that is a Hugging Face repo id rather than a directory: the branch, tag or "
                        "commit of it to take from the local Hugging Face cache (default: main)")
    p.add_argument("--download-dir", default=None,
                   help="the Hugging Face cache directory to look the model up in (default: $HF_HOME's hub "
                        "directory)")
    p.add_check(_log_no_effect)


def add_model_positional(p: CommandParser) -> None:
    """serve's optional MODEL, as `vllm serve MODEL`: the same as --model (both given and
    different: refused)."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model to serve, as in `vllm serve MODEL`: a directory, or a Hugging Face repo id "
                        "already in the local cache; the same as --model (default: --model's)")
    p.add_check(_take_model_positional)


def _take_model_positional(parser: CommandParser, args: argparse.Namespace) -> None:
    tag = vars(args).pop("model_tag", None)
    if tag is None:
        return
    if args.model is not None and args.model != tag:
        parser.refuse("MODEL", f"{tag} and --model {args.model} name different models: give one of them")
    args.model = tag


def model_of(args: argparse.Namespace) -> str:
    """The model directory the command line names: MODEL / --model (looked up in the local
    Hugging Face cache with --revision and --download-dir when it is not a directory), else the
    default model. FileNotFoundError (one line) when there is none."""
    if not args.model:
        return check_model_dir(default_model_path())
    return resolve_model(args.model, getattr(args, "revision", None), getattr(args, "download_dir", None))


def _log_no_effect(parser: CommandParser, args: argparse.Namespace) -> None:
    if getattr(args, "trust_remote_code", False):
        logger.warning("--trust-remote-code has no effect: my-vllm never runs code from a model's repository")
