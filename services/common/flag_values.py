"""How engine flags read vLLM's value spellings: `--max-model-len 4k`, `--dtype half`.

A vLLM user's command line must mean the same here; each reader raises
argparse.ArgumentTypeError with what is wrong, which argparse reports naming the flag.
"""

from __future__ import annotations

import argparse
import re

# vLLM's suffixes: lower case decimal (1k = 1000; a fraction allowed, 25.6k = 25600), upper case
# binary (1K = 1024; whole numbers only).
DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SUFFIXED = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")

# vLLM's other names for dtypes (torch's aliases): the engine keeps the canonical name.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def human_readable_int(text: str) -> int:
    """'4096', '4k' (4000), '25.6k' (25600), '4K' (4096), '1m' (10**6), '1M' (2**20): vLLM's rule."""
    value = text.strip()
    match = _SUFFIXED.fullmatch(value)
    if match is None:
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {text!r} (a number, optionally with a suffix: "
                                             "k/m/g/t = 10^3/6/9/12, K/M/G/T = 2^10/20/30/40)") from None
    number, suffix = match.groups()
    if suffix in DECIMAL_SUFFIXES:
        return int(float(number) * DECIMAL_SUFFIXES[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"{text!r}: a binary suffix ({suffix}) takes a whole number; did you mean "
                                         f"{number}{suffix.lower()}?")
    return int(number) * BINARY_SUFFIXES[suffix]


def max_model_len_value(text: str) -> int | None:
    """`--max-model-len`: a human-readable int, or 'auto' / -1: the model's own limit (None)."""
    if text.strip().lower() in ("auto", "-1"):
        return None
    value = human_readable_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive (or auto), got {text!r}")
    return value


def dtype_name(text: str) -> str:
    """`--dtype`: the canonical name of one of vLLM's spellings (half -> float16, float -> float32);
    another value passes through for the flag's choices to refuse."""
    value = text.strip().lower()
    return DTYPE_ALIASES.get(value, value)
