"""Matrix products and embedding lookups on GGUF weights kept in their quantized block format
(Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), on the CPU kernels of `quant_gemm.c`.

The weights stay as the GGUF file stores them, a row of blocks per output feature, and are
dequantized a chunk at a time inside the kernel: a token's decode reads the 4- or 8-bit blocks, not
fp32 copies. `QuantGemm.load()` builds the library at first use (cpu/cbuild.py, cached on disk) and
returns None where it cannot (no C compiler): the caller then dequantizes with the gguf package.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from services.worker.cpu import cbuild
from services.worker.quant import QUANT_TYPES, row_bytes

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("quant_gemm.c")
_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
HIGHEST_ISA = "amx_int8"
# Calls on Q4_0, Q4_1 and Q8_0 quantize x per block to 16 bits in two int8 parts and take integer
# dot products (quant_q8.h): several times the fp32 path's speed (quant_gemm.c's header), at the
# cost of x's rounding to 1/64516 of its block's largest value (tests/unit/worker/
# test_quant_kernels.py states the bound). False keeps every call on the exact fp32 products.
INT8_DOT = True
_loaded: dict[str | None, QuantGemm | None] = {}


class QuantGemm:
    """y = x W^T (+ b) and rows of W, for W a GGUF quantized tensor [out_features, row bytes]."""

    def __init__(self, lib: ctypes.CDLL, level: str | None = None) -> None:
        lib.qg_supported.argtypes = [_I]
        lib.qg_supported.restype = _I
        lib.qg_scratch_floats.argtypes = [_I, _I, _I, _I]
        lib.qg_scratch_floats.restype = _I64
        lib.qg_dequantize.argtypes = [_I, _P, _I64, _I, _I64, _P, _I, _P, _I]
        lib.qg_dequantize.restype = _I
        lib.qg_matmul.argtypes = [_I, _P, _I, _P, _I64, _P, _P, _I, _I, _I, _P, _I, _I]
        lib.qg_int8_dot.argtypes = [_I]
        lib.qg_int8_dot.restype = _I
        lib.qg_amx.argtypes = []
        lib.qg_amx.restype = _I
        lib.qg_matmul.restype = None
        self.lib = lib
        self.level = level
        # Grown on demand and kept: a decode step makes hundreds of calls, none of which allocates
        # (bf16 activations converted to fp32, the prefill tiles). One caller at a time, as the
        # worker's model runs.
        self._scratch = torch.empty(0, dtype=torch.float32)

    @classmethod
    def load(cls, level: str | None = None) -> QuantGemm | None:
        """The shared instance built at `level` (None: the best this CPU runs, up to HIGHEST_ISA),
        or None where the library cannot be built (logged once)."""
        if level not in _loaded:
            gemm: QuantGemm | None = None
            try:
                gemm = cls(cbuild.build(_SOURCE, ["-ffp-contract=off"], highest=HIGHEST_ISA, level=level), level)
            except (RuntimeError, OSError) as e:
                logger.warning("quantized CPU kernels unavailable (%s)", e)
            _loaded[level] = gemm
        return _loaded[level]

    def has_int8_dot(self, qtype: int) -> bool:
        """Whether `int8_dot` changes the decode path for `qtype` in this build (AVX2 or better)."""
        return bool(self.lib.qg_int8_dot(int(qtype)))

    def uses_amx(self) -> bool:
        """Whether int8 products of 16 or more rows run on AMX tiles in this build (quant_amx.h)."""
        return bool(self.lib.qg_amx())

    def supports(self, qtype: int) -> bool:
        return int(qtype) in QUANT_TYPES and bool(self.lib.qg_supported(int(qtype)))

    def prepare(self, raw: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
        """The GGUF tensor's bytes [out_features, row bytes] in the layout the kernels read: the
        file's own (returned as is when already contiguous)."""
        size = row_bytes(int(qtype), in_features)
        if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != size:
            raise ValueError(f"expected uint8 [out_features, {size}] for type {qtype}, got {raw.dtype} "
                             f"{list(raw.shape)}")
        return raw.contiguous()

    def _scratch_for(self, floats: int) -> torch.Tensor:
        if self._scratch.numel() < floats:
            self._scratch = torch.empty(floats, dtype=torch.float32)
        return self._scratch

    def matmul(self, x: torch.Tensor, prepared: torch.Tensor, qtype: int, out_features: int, in_features: int,
               bias: torch.Tensor | None = None, int8_dot: bool | None = None) -> torch.Tensor:
        """x [M, in_features] fp32 or bf16, contiguous -> [M, out_features] in x's dtype.
        `int8_dot` (None: INT8_DOT): x quantized per block for integer products, where the build
        has that path for the type (quant_q8.h)."""
        assert x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and x.shape[1] == in_features
        assert x.is_contiguous() and prepared.shape == (out_features, row_bytes(int(qtype), in_features))
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            bias = bias.float().contiguous()
        m = x.shape[0]
        out = torch.empty((m, out_features), dtype=x.dtype)
        if m == 0 or out_features == 0:
            return out
        threads = torch.get_num_threads()
        x_bf16 = int(x.dtype == torch.bfloat16)
        scratch = self._scratch_for(self.lib.qg_scratch_floats(m, in_features, x_bf16, threads))
        self.lib.qg_matmul(int(qtype), x.data_ptr(), x_bf16, prepared.data_ptr(), prepared.shape[1],
                           0 if bias is None else bias.data_ptr(), out.data_ptr(), m, out_features, in_features,
                           scratch.data_ptr(), threads, int(INT8_DOT if int8_dot is None else int8_dot))
        return out

    def dequantize(self, prepared: torch.Tensor, qtype: int, out_features: int, in_features: int,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 [out_features, in_features], or [len(rows), in_features] for the rows `rows` (token
        ids of an embedding lookup), with the same bits as gguf.quants.dequantize."""
        assert prepared.shape == (out_features, row_bytes(int(qtype), in_features)) and prepared.is_contiguous()
        index = None if rows is None else rows.reshape(-1).to(torch.int64).contiguous()
        count = out_features if index is None else index.numel()
        out = torch.empty((count, in_features), dtype=torch.float32)
        if count and self.lib.qg_dequantize(int(qtype), prepared.data_ptr(), prepared.shape[1], in_features,
                                            out_features, None if index is None else index.data_ptr(), count,
                                            out.data_ptr(), torch.get_num_threads()):
            raise IndexError(f"row index out of range [0, {out_features})")
        return out
