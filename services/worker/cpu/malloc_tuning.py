"""Keep freed activation memory in the process instead of handing it back to the kernel (glibc).

torch's CPU allocator is plain malloc/free. glibc serves every block above its mmap threshold
(128 KiB, raised dynamically up to 32 MiB) with a fresh mmap and unmaps it on free, and trims
the heap's top above the trim threshold; the next step's activations then fault every page in
again, zero-filled by the kernel. A prefill step of 2,048 tokens allocates ~200 MB of
activations this way, so page faults (`clear_page`) showed up as a visible share of a profile.
Raising both thresholds once keeps that memory mapped and reused: an order of magnitude fewer
faults and a little more throughput (BENCHMARKS.md, "CPU kernels"). vLLM's CPU guide gets the same from
preloading tcmalloc; an in-process `LLM` cannot preload an allocator after the interpreter has started, mallopt can.

The price is that the process keeps its peak of transient memory (at most a few hundred MB of
activations for this engine's step sizes) instead of returning it between steps.
`MYVLLM_CPU_MALLOC_TUNING=0` leaves glibc's defaults alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

# glibc caps the mmap threshold at HEAP_MAX_SIZE / 2 (32 MiB on 64-bit builds); larger blocks
# (a big batch's logits) keep being mapped, which is rare enough not to matter.
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30
TOP_PAD_BYTES = 64 << 20

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; True when they are set (False
    on a libc without mallopt, e.g. musl, or when turned off by the environment)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("MYVLLM_CPU_MALLOC_TUNING", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        logger.info("no mallopt in this C library (%s): glibc's malloc thresholds left as they are", name)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        (M_TOP_PAD, TOP_PAD_BYTES)))
    if not ok:
        logger.info("mallopt refused a malloc threshold: activations may be re-faulted every step")
    _applied = ok
    return ok


def release_freed_memory() -> bool:
    """Return the free pages of every malloc arena to the OS (glibc's malloc_trim): the raised
    trim threshold above otherwise keeps up to a GiB of freed memory in a process that has
    dropped a model. False where the C library has no malloc_trim."""
    try:
        return bool(ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0))
    except (OSError, AttributeError, TypeError):
        return False
