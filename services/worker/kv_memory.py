"""KV cache tensors, allocated once per layer.

On the CPU the cache is an anonymous memory mapping: the kernel hands out zero-filled pages
on first touch, so a cache costs resident memory only as far as requests have written it
(a 2 GiB default cache behind a lightly used server, or a test, costs megabytes), and nothing
has to be written to make it zero. On a GPU, `torch.zeros`.
"""

from __future__ import annotations

import math
import mmap

import torch


def zeroed_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros of `shape` (zeros: never-written slots are masked out, but 0 * NaN garbage would
    still be NaN). The CPU tensor keeps its mapping alive and unmaps it when freed."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
