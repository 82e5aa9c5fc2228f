"""The fused elementwise ops of `cpu_ops.c` on torch tensors (CPU, fp32 or bf16).

`CpuOps.load()` builds the library at first use (about a second, then cached on disk) and
returns None where it cannot (no C compiler), in which case the model keeps its torch ops.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from services.worker.cpu import cbuild

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_ops.c")
DTYPES = (torch.float32, torch.bfloat16)
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "rms_norm": [_P, _I64, _P, _P, _I, _I, _F, _I, _I],
    "fused_add_rms_norm": [_P, _P, _P, _I, _I, _F, _I, _I],
    "silu_and_mul": [_P, _P, _I, _I, _I, _I],
    "rope_neox": [_P, _I64, _I, _I, _I, _P, _P, _P, _I, _I],
    "argmax_rows": [_P, _I64, _I, _I, _P, _I, _I],
}
# SiLU·up has a 16-lane path (row_ops.h) with the same arithmetic per element as its 8-lane loop; the
# other ops' explicit 8-lane code is the same at either level. So results do not depend on the
# level. The fused op reads its input once where torch's two ops (F.silu, mul) read it twice, which
# is why it beats them at every row count (BENCHMARKS.md, "CPU kernels").
HIGHEST_ISA = "avx512"
_loaded: CpuOps | None = None
_failed = False

class CpuOps:
    """One pass per op instead of several torch ops; see cpu_ops.c for the arithmetic."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, argtypes in _SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = None
        self.lib = lib

    @classmethod
    def build(cls, level: str | None = None) -> CpuOps:
        """A new instance built at instruction-set `level` (None: the best this CPU runs, up to
        HIGHEST_ISA); raises RuntimeError / OSError where it cannot be built."""
        return cls(cbuild.build(_SOURCE, ["-ffp-contract=off"], highest=HIGHEST_ISA, level=level))

    @classmethod
    def load(cls) -> CpuOps | None:
        """The shared instance, or None (logged once) where the library cannot be built."""
        global _loaded, _failed
        if _loaded is None and not _failed:
            try:
                _loaded = cls.build()
            except (RuntimeError, OSError) as e:
                _failed = True
                logger.warning("fused CPU ops unavailable (%s); the model runs its torch ops", e)
        return _loaded

    @staticmethod
    def supports(t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.dtype in DTYPES

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each row of x ([M, H], rows may be strided) into a new contiguous tensor."""
        assert x.stride(-1) == 1 and weight.dtype == x.dtype
        m, h = x.shape
        out = torch.empty((m, h), dtype=x.dtype)
        self.lib.rms_norm(x.data_ptr(), x.stride(0), out.data_ptr(), weight.data_ptr(), m, h, eps,
                          x.dtype == torch.bfloat16, torch.get_num_threads())
        return out

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> None:
        """In place: residual += x, then x = RMSNorm(residual). Both [M, H] contiguous."""
        assert x.is_contiguous() and residual.is_contiguous() and x.shape == residual.shape
        assert x.dtype == residual.dtype == weight.dtype
        m, h = x.shape
        self.lib.fused_add_rms_norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), m, h, eps,
                                    x.dtype == torch.bfloat16, torch.get_num_threads())

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [gate | up] ([M, 2I] contiguous) → [M, I]."""
        assert gate_up.is_contiguous()
        m, two_i = gate_up.shape
        out = torch.empty((m, two_i // 2), dtype=gate_up.dtype)
        self.lib.silu_and_mul(gate_up.data_ptr(), out.data_ptr(), m, two_i // 2,
                              gate_up.dtype == torch.bfloat16, torch.get_num_threads())
        return out

    def rope_neox_(self, x: torch.Tensor, num_heads: int, head_dim: int, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate, in place, the first `num_heads` heads of each row of x ([T, >= num_heads *
        head_dim], rows may be strided) by the fp32 cos/sin table rows at `positions` (int64)."""
        assert x.stride(-1) == 1 and x.shape[1] >= num_heads * head_dim
        assert positions.dtype == torch.int64 and positions.is_contiguous() and len(positions) == x.shape[0]
        assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
        self.lib.rope_neox(x.data_ptr(), x.stride(0), x.shape[0], num_heads, head_dim, positions.data_ptr(),
                           cos.data_ptr(), sin.data_ptr(), x.dtype == torch.bfloat16, torch.get_num_threads())

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first index of its largest value (of its first NaN, if any), as
        torch.max(logits, dim=-1).indices, which runs ~10x slower over a vocabulary of logits
        (a 64-row step spent ~2 ms there, more than its sampling otherwise)."""
        assert logits.dim() == 2 and logits.stride(-1) == 1 and self.supports(logits)
        m, n = logits.shape
        ids = torch.empty(m, dtype=torch.int64)
        self.lib.argmax_rows(logits.data_ptr(), logits.stride(0), m, n, ids.data_ptr(),
                             logits.dtype == torch.bfloat16, torch.get_num_threads())
        return ids
