"""CPU attention: the torch reference for prefill chunks, a small C kernel for decodes.

Decode attention on CPU is memory bound. The torch reference first gathers every decode
request's K/V blocks into a dense copy, then reads them again in SDPA: three passes over
the cache per layer. `cpu_paged_decode.c` reads K/V in place through the block table in
one pass, on torch's own OpenMP threads. It is built at first use by `cpu/cbuild.py` (a fixed
x86-64 level, so every machine of that level runs the same code); without a compiler this
backend is unavailable and `torch` is used.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from services.worker.attention.base import AttentionMetadata
from services.worker.attention.torch_backend import TorchAttentionBackend, _TorchPlan
from services.worker.cpu import cbuild

_SOURCE = Path(__file__).with_name("cpu_paged_decode.c")
_lib: ctypes.CDLL | None = None


def load_library() -> ctypes.CDLL:
    """Compile (once per source version) and load the decode kernel."""
    global _lib
    if _lib is not None:
        return _lib
    lib = cbuild.build(_SOURCE)
    lib.paged_decode.restype = ctypes.c_int
    lib.paged_decode.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + \
        [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.exp_neg_lanes.restype = None
    lib.exp_neg_lanes.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    _lib = lib
    return lib


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        self.lib = load_library()

    def prepare(self, meta: AttentionMetadata) -> _TorchPlan:
        plan = super().prepare(meta)
        if plan.decode_rows is not None:
            plan.decode_block_table = meta.block_table.index_select(0, plan.decode_rows).contiguous()
        return plan

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _TorchPlan,
                scale: float) -> torch.Tensor:
        if k_cache.dtype not in (torch.float32, torch.bfloat16) or k_cache.device.type != "cpu":
            return super()._decode(q, k_cache, v_cache, plan, scale)
        num_reqs, num_heads, head_dim = q.shape
        in_dtype = q.dtype
        q = (q if in_dtype in (torch.float32, torch.bfloat16) else q.float()).contiguous()
        out = torch.empty_like(q)  # the kernel reads and writes fp32 or bf16 itself
        bt, seq_lens = plan.decode_block_table, plan.decode_seq_lens
        rc = self.lib.paged_decode(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr(), bt.stride(0),
            seq_lens.data_ptr(), out.data_ptr(), num_reqs, num_heads, k_cache.shape[2], head_dim,
            k_cache.shape[1], scale, int(k_cache.dtype == torch.bfloat16), int(q.dtype == torch.bfloat16),
            torch.get_num_threads())
        if rc != 0:
            raise MemoryError("cpu paged decode kernel could not allocate its scratch memory")
        return out.to(in_dtype)
