"""Linear layers on our own AVX-512 GEMM (`gemm.c`), for CPU workers: weights packed once into
column blocks that stream from memory; fp32, and bf16 where the CPU has AVX512_BF16. Faster than
oneDNN's prepacked GEMMs at decode sizes and level with them on prefill-sized batches (see
gemm.c). Where the CPU has no AVX-512, or the library cannot be built, `PanelGemm.load()`
returns None and the layers keep oneDNN (as bf16 layers do without AVX512_BF16, and with AMX).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from services.common.config import cpu_flags
from services.worker.cpu import cbuild, huge_pages

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("gemm.c")
_P, _I = ctypes.c_void_p, ctypes.c_int
BLOCK = 32  # output columns per packed block (gemm.c's NB)
HIGHEST_ISA = "amx_bf16"
_loaded: dict[str | None, PanelGemm | None] = {}


def keeps_onednn_for_bf16(flags: set[str] | None = None, has_amx_tiles: bool = False) -> bool:
    """Whether bf16 layers stay on oneDNN: on CPUs with AMX (`amx_bf16` among the CPU flags)
    oneDNN's bf16 GEMMs run on the tiles, several times vdpbf16ps's rate from a few rows up, so
    they do unless this GEMM was built with the tiles too (`has_amx_tiles`)."""
    return "amx_bf16" in (cpu_flags() if flags is None else flags) and not has_amx_tiles


class PanelGemm:
    """y = x W^T + b with W packed by `pack` (out_features a multiple of BLOCK; bf16: in_features
    even)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.gemm_available.argtypes = [_I]
        lib.gemm_available.restype = _I
        lib.gemm_pack.argtypes = [_P, _P, _I, _I, _I]
        lib.gemm_pack.restype = None
        lib.gemm.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I, _I]
        lib.gemm.restype = None
        lib.gemm_amx_bf16.restype = _I
        self.lib = lib
        self.amx_bf16 = bool(lib.gemm_amx_bf16())
        self.dtypes = tuple(dtype for dtype, bf16 in ((torch.float32, 0), (torch.bfloat16, 1))
                            if lib.gemm_available(bf16) and not (bf16 and keeps_onednn_for_bf16(None, self.amx_bf16)))

    @classmethod
    def load(cls, level: str | None = None) -> PanelGemm | None:
        """The shared instance built at `level` (None: the best this CPU runs, up to amx_bf16), or
        None where this CPU has no AVX-512 or nothing could be built (logged once)."""
        if level not in _loaded:
            gemm: PanelGemm | None = None
            try:
                gemm = cls(cbuild.build(_SOURCE, highest=HIGHEST_ISA, level=level))
                if not gemm.dtypes:
                    gemm = None
            except (RuntimeError, OSError) as e:
                logger.warning("AVX-512 GEMM unavailable (%s); linear layers use oneDNN", e)
            _loaded[level] = gemm
        return _loaded[level]

    def supports(self, weight: torch.Tensor) -> bool:
        return (weight.dtype in self.dtypes and weight.dim() == 2 and weight.shape[0] % BLOCK == 0
                and (weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0))

    def pack(self, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, K] → the packed copy (same size and dtype; gemm.c's layout), into `out` when given."""
        assert self.supports(weight)
        weight = weight.detach().contiguous()
        packed = huge_pages.empty(weight.shape, weight.dtype) if out is None else out
        assert packed.shape == weight.shape and packed.dtype == weight.dtype and packed.is_contiguous()
        self.lib.gemm_pack(weight.data_ptr(), packed.data_ptr(), weight.shape[0], weight.shape[1],
                           int(weight.dtype == torch.bfloat16))
        return packed

    def matmul(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] in the weight's dtype → [..., N]."""
        n, k = packed.shape
        assert x.dtype == packed.dtype and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
        rows = x.reshape(-1, k)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.empty((rows.shape[0], n), dtype=x.dtype)
        if rows.shape[0]:
            self.lib.gemm(rows.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(), out.data_ptr(),
                          rows.shape[0], k, n, int(x.dtype == torch.bfloat16), torch.get_num_threads())
        return out.view(*x.shape[:-1], n)
