"""The routed experts of an MoE layer in one C call (`moe_experts.c`), for CPU workers: the expert
weights packed once at load, then per layer the grouping by expert, both GEMMs, SiLU(gate) * up
and the weighted per-token sum in C, with no host sync. fp32 and bf16, on CPUs with AVX2 or
AVX-512. Where the CPU has neither or the library cannot be built, `CpuMoeExperts.load()` returns
None and the experts keep the torch path (models/moe.py's `grouped_experts`).

On a CPU with AMX, oneDNN's bf16 GEMMs (the torch path's) run on its tiles and beat this kernel on
large groups (prefill chunks), while this kernel wins decode steps by more (BENCHMARKS.md,
"Mixture-of-experts"); bf16 runs here anyway.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from services.worker.cpu import cbuild, huge_pages

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("moe_experts.c")
_P, _I = ctypes.c_void_p, ctypes.c_int
BLOCK = 32  # output columns per packed block (gemm_tile.h's NB)
HIGHEST_ISA = "avx512_bf16"
_loaded: dict[str | None, CpuMoeExperts | None] = {}


def _whole_blocks(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


class CpuMoeExperts:
    """Packed expert weights: w13 [E, 2I, H] → [E, Ip / 32, 2, H, 32] (each block of 32
    intermediate columns: its gate block, then its up block) and w2 [E, H, I] → [E, Hp / 32, Ip,
    32], Ip and Hp rounded up to whole blocks with zeros (bf16 blocks hold pairs of k side by
    side: same shapes, see moe_experts.c)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.moe_available.argtypes = [_I]
        lib.moe_available.restype = _I
        lib.moe_pack.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I]
        lib.moe_pack.restype = None
        lib.moe_experts.argtypes = [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I]
        lib.moe_experts.restype = _I
        self.lib = lib
        self.dtypes = tuple(dtype for dtype, bf16 in ((torch.float32, 0), (torch.bfloat16, 1))
                            if lib.moe_available(bf16))

    @classmethod
    def load(cls, level: str | None = None) -> CpuMoeExperts | None:
        """The shared instance built at `level` (None: the best this CPU runs, up to avx512_bf16), or
        None where this CPU has no AVX2 or nothing could be built (logged once)."""
        if level not in _loaded:
            kernel: CpuMoeExperts | None = None
            try:
                kernel = cls(cbuild.build(_SOURCE, ["-ffp-contract=off"], highest=HIGHEST_ISA, level=level))
                if not kernel.dtypes:
                    kernel = None
            except (RuntimeError, OSError) as e:
                logger.warning("CPU MoE kernel unavailable (%s); the experts run on torch", e)
            _loaded[level] = kernel
        return _loaded[level]

    def supports(self, w13: torch.Tensor) -> bool:
        """Whether stacked gate/up weights [E, 2I, H] can be packed for this kernel."""
        return (w13.device.type == "cpu" and w13.dtype in self.dtypes and w13.dim() == 3
                and (w13.dtype != torch.bfloat16 or w13.shape[2] % 2 == 0))

    def pack(self, w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) → their packed copies (the class's layout)."""
        assert self.supports(w13) and w2.dtype == w13.dtype
        w13, w2 = w13.detach().contiguous(), w2.detach().contiguous()
        num_experts, hidden, width = w2.shape
        assert w13.shape == (num_experts, 2 * width, hidden)
        width_p, hidden_p = _whole_blocks(width), _whole_blocks(hidden)
        w13p = huge_pages.empty((num_experts, width_p // BLOCK, 2, hidden, BLOCK), w13.dtype)
        w2p = huge_pages.empty((num_experts, hidden_p // BLOCK, width_p, BLOCK), w2.dtype)
        self.lib.moe_pack(w13.data_ptr(), w2.data_ptr(), w13p.data_ptr(), w2p.data_ptr(), num_experts, hidden,
                          width, width_p, hidden_p, int(w13.dtype == torch.bfloat16), torch.get_num_threads())
        return w13p, w2p

    def experts(self, x: torch.Tensor, w13p: torch.Tensor, w2p: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
        """moe.grouped_experts on packed weights: x [T, H] in their dtype, weights [T, k] (fp32 or
        bf16) and ids [T, k] int64 (an id outside [0, E) adds nothing) → [T, H]."""
        num_experts, hidden = w13p.shape[0], w13p.shape[3]
        assert x.dtype == w13p.dtype == w2p.dtype and x.shape[-1] == hidden and ids.dtype == torch.int64
        assert weights.dtype in (torch.float32, torch.bfloat16) and weights.shape == ids.shape
        x, weights, ids = x.contiguous(), weights.contiguous(), ids.contiguous()
        out = torch.empty_like(x)
        if x.shape[0] == 0:
            return out
        failed = self.lib.moe_experts(
            x.data_ptr(), w13p.data_ptr(), w2p.data_ptr(), weights.data_ptr(), ids.data_ptr(), out.data_ptr(),
            x.shape[0], ids.shape[1], num_experts, hidden, w13p.shape[1] * BLOCK, w2p.shape[1] * BLOCK,
            int(x.dtype == torch.bfloat16), int(weights.dtype == torch.bfloat16), torch.get_num_threads())
        if failed:
            raise MemoryError("the CPU MoE kernel could not allocate its scratch memory")
        return out
