"""The command line's parser class: every `myvllm` command and subcommand is one of these.

- No abbreviations: argparse would otherwise take any unambiguous prefix of a flag, so a vLLM
  flag we lack could silently become another one (`--tokenizer PATH` read as
  `--tokenizer-pool-size PATH`, `--max-model 100` as `--max-model-len 100`).
- Every flag's help ends with its default (unless the help already speaks of it), as
  `vllm serve --help` shows them.
- Checks that need the whole command line (a positional MODEL against `--model`) run once it is
  parsed: `add_check`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

Check = Callable[["CommandParser", argparse.Namespace], None]


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """argparse's ArgumentDefaultsHelpFormatter, minus the repetition: a help text that already
    names its default ("default: the model's", "(default 256)") is left as it is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default is argparse.SUPPRESS or action.required:
            return text  # (a required flag has no default to show)
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)"
        return text


def shown_help(action: argparse.Action) -> str:
    """An action's help as `--help` prints it (its default filled in)."""
    return DefaultsHelpFormatter("myvllm")._expand_help(action)


class CommandParser(argparse.ArgumentParser):
    """argparse.ArgumentParser without abbreviations, with defaults in the help and post-parse
    checks. Subparsers are of the same class (argparse makes them with the parent's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
        self._checks: list[Check] = []

    def add_check(self, check: Check) -> None:
        """`check(parser, args)` runs once this parser has parsed its arguments; it refuses a
        combination with `parser.error`."""
        self._checks.append(check)

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = super().parse_known_args(args, namespace)
        for check in self._checks:
            check(self, namespace)
        return namespace, extras

    def refuse(self, option: str, reason: str) -> None:
        """Exit 2 with one line naming the flag and why (no usage block: the line says it all)."""
        self.exit(2, f"{self.prog}: error: argument {option}: {reason}\n")
