"""Host tensors backed by 2 MiB pages, for weights the CPU kernels stream every step.

Why: a decode step reads every packed weight once from memory, and with the 4 KiB pages a
process gets by default the hardware prefetchers stop at every page boundary and the TLB misses
every few KiB; the experts' kernel streamed 23-29 GB/s of a machine's 32 there at one token and
36-38 GB/s from 2 MiB pages (BENCHMARKS.md, "Against the roofline, and vLLM, on one CPU").
Transparent huge pages are commonly enabled only for memory that asks (`madvise` mode), so the
memory is mapped here and asks (MADV_HUGEPAGE) before anything touches it. Where the kernel has
THP off, or the call fails, the memory is ordinary pages: nothing else changes.
MYVLLM_HUGE_PAGES=0 turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
import os
import sys
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
# Below this a tensor is left to torch's allocator: its 2 MiB-aligned interior would be small.
MIN_BYTES = 4 * HUGE_PAGE

_madvise = None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        _madvise = libc.madvise
    return _madvise


def enabled() -> bool:
    """Whether large tensors ask for huge pages: on Linux (madvise's advice numbers are its own),
    unless MYVLLM_HUGE_PAGES=0."""
    return os.environ.get("MYVLLM_HUGE_PAGES", "1") != "0" and sys.platform == "linux"


def empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor; from MIN_BYTES up, in an anonymous mapping aligned to 2 MiB
    that asked for huge pages before its first touch (the tensor keeps the mapping alive)."""
    nbytes = math.prod(int(n) for n in shape) * dtype.itemsize
    if nbytes < MIN_BYTES or not enabled():
        return torch.empty(tuple(shape), dtype=dtype)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    if _libc_madvise()(raw.data_ptr() + offset, nbytes, MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed (errno %d): ordinary pages", ctypes.get_errno())
    return raw[offset:offset + nbytes].view(dtype).view(tuple(shape))
