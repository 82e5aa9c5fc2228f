"""The memory-bandwidth floor of decoding: at batch 1 every weight is read once per token, so no
engine decodes a token faster than (bytes of weights) / (read bandwidth of the machine).

`bench latency` prints the floor for the model it runs and each peer's efficiency (floor over its
measured inter-token latency); a kernel benchmark can hold a GEMM against the same bandwidth.

Bytes per token: every tensor's stored size (quantized sizes for a GGUF), except the input
embedding, of which a token reads one row (negligible); a tied embedding is read whole once, as
the LM head. Bandwidth: a streaming read (a sum) of a buffer far larger than any last-level
cache (`streaming_buffer_bytes`: at least 1 GiB and four times the L3), best of a few runs, on
the thread count the bench uses.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["WeightFloor", "gguf_weight_bytes", "last_level_cache_bytes", "read_bandwidth_bytes_s",
           "safetensors_weight_bytes", "streaming_buffer_bytes", "weight_bytes_per_token"]

DEFAULT_BUFFER_BYTES = 1 << 30
# A buffer this many times the last-level cache is read from memory, whatever the cache keeps.
CACHE_MULTIPLE = 4
_CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SAFETENSORS_HEADER_LEN = 8  # a little-endian u64: the JSON header's length
_GGUF_EMBEDDING = "token_embd.weight"
_GGUF_LM_HEAD = "output.weight"


@dataclass(frozen=True)
class WeightFloor:
    """Bytes of weights read per decoded token and the machine's read bandwidth."""

    weight_bytes: int
    bandwidth_bytes_s: float

    @property
    def floor_s(self) -> float:
        """The least time one decoded token can take: every weight read once at full bandwidth."""
        return self.weight_bytes / self.bandwidth_bytes_s

    def efficiency(self, itl_s: float) -> float:
        """The floor over a measured inter-token latency (1 = at the bandwidth limit)."""
        return self.floor_s / itl_s

    def describe(self, itl_s: float | None = None) -> str:
        text = f"{self.weight_bytes / 1e6:.1f} MB of weights per token, floor {self.floor_s * 1e3:.2f} ms/token"
        if itl_s is not None and itl_s > 0:
            text += f", efficiency (floor / ITL) {self.efficiency(itl_s):.2f}"
        return text


def last_level_cache_bytes(cache_dir: Path = _CPU_CACHES) -> int:
    """The size of CPU 0's largest-level data or unified cache from sysfs (0 where it cannot be
    read: not Linux, or a container without /sys)."""
    best_level, best_size = 0, 0
    for index in sorted(cache_dir.glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or level < best_level:
            continue
        number, unit = (size[:-1], size[-1]) if size[-1:] in _SIZE_UNITS else (size, "")
        try:
            best_level, best_size = level, int(number) * _SIZE_UNITS.get(unit, 1)
        except ValueError:
            continue
    return best_size


def streaming_buffer_bytes(cache_bytes: int | None = None) -> int:
    """The buffer a bandwidth measurement reads: 1 GiB, or four times the last-level cache when
    that is larger (a VM may report hundreds of MiB of L3), rounded up to a whole GiB."""
    cache_bytes = last_level_cache_bytes() if cache_bytes is None else cache_bytes
    needed = max(DEFAULT_BUFFER_BYTES, CACHE_MULTIPLE * cache_bytes)
    return -(-needed // DEFAULT_BUFFER_BYTES) * DEFAULT_BUFFER_BYTES


def read_bandwidth_bytes_s(threads: int, buffer_bytes: int | None = None, repeats: int = 3) -> float:
    """Bytes per second of a streaming read over `buffer_bytes` of fp32 (`torch.sum`; default
    `streaming_buffer_bytes()`) with `threads` intra-op threads, best of `repeats` (the
    machine's other load only slows a run)."""
    import time

    import torch

    buffer_bytes = streaming_buffer_bytes() if buffer_bytes is None else buffer_bytes
    if threads < 1 or repeats < 1 or buffer_bytes < 4:
        raise ValueError(f"threads, repeats and buffer_bytes must be positive, got {threads}, {repeats}, "
                         f"{buffer_bytes}")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(buffer_bytes // 4, dtype=torch.float32)  # written once: its pages are resident
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
        return buffer.numel() * 4 / best
    finally:
        torch.set_num_threads(previous)


def gguf_weight_bytes(path: str) -> int:
    """Stored bytes of a GGUF's tensors read per token: all but the token embedding, which counts
    once as the LM head when the file has no separate `output.weight` (tied)."""
    from gguf import GGUFReader

    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    return _per_token(sizes, _GGUF_EMBEDDING, tied=_GGUF_LM_HEAD not in sizes)


def safetensors_weight_bytes(model_dir: str, dtype_bytes: int) -> int:
    """Bytes per token of a Hugging Face checkpoint run at `dtype_bytes` per element: every
    tensor's element count (from the safetensors headers) at that size, the input embedding
    only when it is the LM head (no `lm_head.weight` stored)."""
    numels: dict[str, int] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(_SAFETENSORS_HEADER_LEN))
            header = json.loads(f.read(length))
        for name, info in header.items():
            if name != "__metadata__":
                numel = 1
                for d in info["shape"]:
                    numel *= int(d)
                numels[name] = numel * dtype_bytes
    if not numels:
        raise FileNotFoundError(f"no .safetensors file in {model_dir}")
    embedding = next((n for n in numels if n.endswith("embed_tokens.weight")), "")
    # Without a stored lm_head the embedding is the LM head (tied), read whole every token.
    return _per_token(numels, embedding, tied=not any(n.endswith("lm_head.weight") for n in numels))


def _per_token(sizes: dict[str, int], embedding: str, tied: bool) -> int:
    """The sum of `sizes`, the embedding included only when it doubles as the LM head."""
    return sum(size for name, size in sizes.items() if tied or name != embedding)


def weight_bytes_per_token(model: str, dtype_bytes: int) -> int:
    """Bytes of weights a decoded token reads for `model`: a .gguf file at its stored (quantized)
    sizes, a checkpoint directory at `dtype_bytes` per element."""
    if model.endswith(".gguf"):
        return gguf_weight_bytes(model)
    return safetensors_weight_bytes(model, dtype_bytes)
