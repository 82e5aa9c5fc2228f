"""The instruction-set levels a CPU kernel's tests run at (cpu/cbuild.py builds a kernel per level)."""

from __future__ import annotations

from services.worker.cpu import cbuild

# The levels with code of their own in our kernels (#ifdef __AVX512BF16__ / __AVX512F__ / AVX2).
DISTINCT_LEVELS = ("avx512_bf16", "avx512", "avx2")


def levels_here(highest: str) -> list[str | None]:
    """Each level this CPU runs, up to `highest`, that has code of its own; [None] (the compiler's
    default target) where none does (off x86)."""
    levels = [level for level in cbuild.isa_levels(highest=highest) if level in DISTINCT_LEVELS]
    return levels or [None]
