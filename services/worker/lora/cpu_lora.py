"""The per-token LoRA kernel for CPUs (services/worker/cpu/lora_bgmv.c) on torch tensors: each
token reads only its own slot's weights. `CpuLora.load()` builds it at first use (cached on disk)
and returns None where it cannot (no C compiler): the dense masked products then run."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from services.worker.cpu import cbuild

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).resolve().parents[1] / "cpu" / "lora_bgmv.c"
_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
HIGHEST_ISA = "avx2"  # 8-lane loops (vec.h); wider builds gain nothing at these sizes
_loaded: CpuLora | None = None
_failed = False


class CpuLora:
    DTYPES = (torch.float32, torch.bfloat16)  # what lora_bgmv.c reads (fp16 runs the dense products)

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.lora_bgmv.argtypes = [_P, _I64, _P, _I64, _P, _P, _I64, _P, _I, _I, _I, _I, _I, _I, _P, _I, _I]
        lib.lora_bgmv.restype = None
        self.lib = lib

    @classmethod
    def load(cls) -> CpuLora | None:
        global _loaded, _failed
        if _loaded is None and not _failed:
            try:
                _loaded = cls(cbuild.build(_SOURCE, highest=HIGHEST_ISA))
            except (RuntimeError, OSError) as e:
                _failed = True
                logger.warning("per-token LoRA kernel unavailable (%s); adapters run as dense products", e)
        return _loaded

    def add(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
            part_starts: torch.Tensor, num_slots: int, rank: int) -> torch.Tensor:
        """y[t, part columns] += B_part[slot_t] @ (A_part[slot_t] @ x[t]) in place; `part_starts`:
        int32 [parts + 1], the parts' first columns and the end."""
        assert y.stride(1) == 1 and x.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
        same = y.dtype == x.dtype == a.dtype == b.dtype
        if not (same and y.dtype in self.DTYPES and token_slots.dtype == torch.int32):
            raise TypeError(f"lora_bgmv takes fp32 or bf16 tensors of one dtype and int32 slots, got {y.dtype}")
        parts = part_starts.numel() - 1
        self.lib.lora_bgmv(y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), a.data_ptr(), b.data_ptr(),
                           b.stride(0),
                           token_slots.data_ptr(), x.shape[0], x.shape[1], y.shape[1], parts, num_slots, rank,
                           part_starts.data_ptr(), int(y.dtype == torch.bfloat16), torch.get_num_threads())
        return y
