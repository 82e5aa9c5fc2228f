"""The instruction-set levels a CPU kernel's tests run at (cpu/cbuild.py builds a kernel per level)."""

from __future__ import annotations

from services.worker.cpu import cbuild

# The levels with code of their own in our kernels (#ifdef __AVX512BF16__ / __AVX512F__ / AVX2),
# and amx_bf16 in the kernels built on gemm.c's tiles (#ifdef __AMX_BF16__), whose highest level
# it is.
DISTINCT_LEVELS = ("avx512_bf16", "avx512", "avx2")


def levels_here(highest: str) -> list[str | None]:
    """Each level this CPU runs, up to `highest`, that has code of its own; [None] (the compiler's
    default target) where none does (off x86)."""
    distinct = DISTINCT_LEVELS + (("amx_bf16",) if highest == "amx_bf16" else ())
    levels = [level for level in cbuild.isa_levels(highest=highest) if level in distinct]
    return levels or [None]
