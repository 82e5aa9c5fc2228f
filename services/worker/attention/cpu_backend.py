"""CPU attention: small C kernels for decodes (`cpu_paged_decode.c`) and prefill chunks
(`cpu_paged_prefill.c`), the torch reference where they do not apply.

Decode attention on CPU is memory bound. The torch reference first gathers every decode
request's K/V blocks into a dense copy, then reads them again in SDPA: three passes over
the cache per layer. `cpu_paged_decode.c` reads K/V in place through the block table in
one pass, on torch's own OpenMP threads. Both kernels are built at first use by `cpu/cbuild.py`
at a fixed x86-64 level, the best this CPU runs up to AVX-512 with bf16 dot products (so every
machine of a level runs the same code); without a compiler this backend is unavailable and
`torch` is used.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from services.worker.attention.base import AttentionMetadata
from services.worker.attention.torch_backend import TorchAttentionBackend, _TorchPlan
from services.worker.cpu import cbuild

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_paged_decode.c")
_PREFILL_SOURCE = Path(__file__).with_name("cpu_paged_prefill.c")
# The attention kernels carry AVX-512 code (16 lanes; bf16 dot products): built at the best level
# this CPU runs, up to this one (cbuild's docstring).
HIGHEST_ISA = "avx512_bf16"
_libs: dict[tuple[str, str | None], ctypes.CDLL] = {}


def load_library(level: str | None = None) -> ctypes.CDLL:
    """Compile (once per source version and ISA level) and load the decode kernel; `level`
    None: the best this CPU runs."""
    key = ("decode", level)
    if key not in _libs:
        lib = cbuild.build(_SOURCE, highest=HIGHEST_ISA, level=level)
        lib.paged_decode.restype = ctypes.c_int
        lib.paged_decode.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + \
            [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.exp_neg_lanes.restype = None
        lib.exp_neg_lanes.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        _libs[key] = lib
    return _libs[key]


def load_prefill_library(level: str | None = None) -> ctypes.CDLL:
    """Compile (once per source version and ISA level) and load the prefill kernel."""
    key = ("prefill", level)
    if key not in _libs:
        lib = cbuild.build(_PREFILL_SOURCE, highest=HIGHEST_ISA, level=level)
        lib.paged_prefill.restype = ctypes.c_int
        lib.paged_prefill.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 5 + \
            [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
        _libs[key] = lib
    return _libs[key]


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, isa_level: str | None = None) -> None:
        """`isa_level`: the kernels' instruction-set level (cbuild.ISA_LEVELS); None: the best this
        CPU runs (tests pass each level in turn)."""
        self.lib = load_library(isa_level)
        try:
            self.prefill_lib: ctypes.CDLL | None = load_prefill_library(isa_level)
        except (RuntimeError, OSError) as e:
            logger.warning("cpu prefill kernel unavailable (%s); prefill chunks use torch's SDPA", e)
            self.prefill_lib = None

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

    def _prefills(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, plan: _TorchPlan, meta: AttentionMetadata, scale: float,
                  out: torch.Tensor) -> None:
        """Every prefill chunk of the step in one call, reading K/V from the cache (where the
        forward stored this step's own before attending)."""
        head_dim = q.shape[2]
        if (self.prefill_lib is None or k_cache.dtype not in (torch.float32, torch.bfloat16) or q.dtype != k_cache.dtype
                or k_cache.device.type != "cpu" or head_dim % 8 or q.stride(2) != 1 or q.stride(1) != head_dim
                or not out.is_contiguous() or meta.block_table.dtype != torch.int32):
            super()._prefills(q, k, v, k_cache, v_cache, plan, meta, scale, out)
            return
        chunks = torch.tensor([[p.row, p.start, p.end - p.start, p.context_len] for p in plan.prefills],
                              dtype=torch.int32).t().contiguous()
        bt = meta.block_table
        rc = self.prefill_lib.paged_prefill(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr(), bt.stride(0),
            chunks[0].data_ptr(), chunks[1].data_ptr(), chunks[2].data_ptr(), chunks[3].data_ptr(), out.data_ptr(),
            len(plan.prefills), q.shape[1], k_cache.shape[2], head_dim, k_cache.shape[1], scale,
            int(k_cache.dtype == torch.bfloat16), torch.get_num_threads())
        if rc != 0:
            raise MemoryError("cpu paged prefill kernel could not allocate its scratch memory")
