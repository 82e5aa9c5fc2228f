"""What the small decode step (decode_step.c) needs of a model whose projections stay in GGUF
blocks (services/worker/quant): its quantized build of the library, and per projection the
pointers and block type it reads.

The step runs a quantized projection through quant_gemm.c's own decode kernels (quant_q8.h,
quant_f32.h) on each thread's output rows, so its outputs have the bits `quant_matmul` gives the
layer-by-layer forward; it takes a layer held as one block type over all its rows (a fused q/k/v
or gate/up of two types, as llama.cpp's Q4_K_M files have, stays layer by layer) or a dense
nn.Linear in the model's dtype.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from services.worker.cpu import cbuild
from services.worker.quant import QUANT_TYPES
from services.worker.quant import kernels as quant_kernels
from services.worker.quant.weights import QuantWeights

_SOURCE = Path(__file__).with_name("decode_step.c")
_QUANT_DIR = Path(quant_kernels.__file__).parent
_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_libs: dict[str | None, ctypes.CDLL] = {}


def load_quant_library(level: str | None = None) -> ctypes.CDLL:
    """decode_step.c built with its quantized projections, at quant_gemm.c's level (so the int8
    dot products are the same instructions as the layer-by-layer kernels'): a library of its own,
    the dense one keeps its level and bits."""
    if level not in _libs:
        lib = cbuild.build(_SOURCE, ["-ffp-contract=off", "-DMYVLLM_QUANT_STEP"], highest=quant_kernels.HIGHEST_ISA,
                           level=level, include_dirs=[_QUANT_DIR])
        lib.decode_step.restype = _I
        lib.decode_step.argtypes = [_P, _I, _P, _P, _P, _P, _I64, _P, _P, _I]
        lib.lm_head.restype = _I
        lib.lm_head.argtypes = [_P, _P, _P, _I, _I, _I, _I, _I]
        lib.lm_head_quant.restype = _I
        lib.lm_head_quant.argtypes = [_I, _I64, _I, _P, _P, _P, _I, _I, _I, _I, _I]
        lib.max_rows.restype = _I
        lib.quant_tile_min_rows.restype = _I
        lib.quant_int8_dot.restype = _I
        lib.quant_int8_dot.argtypes = [_I]
        _libs[level] = lib
    return _libs[level]


@dataclass
class Projection:
    """One projection as the step reads it: `weight` (dense rows in the model's dtype, or uint8
    blocks [out, row_bytes]), `bias` (the model's dtype for a dense weight, fp32 beside blocks, as
    quant_gemm.c takes it), `qtype` (0: dense) and `row_bytes` (0: dense)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    qtype: int = 0
    row_bytes: int = 0


def projection(module: nn.Module) -> Projection:
    """The step's view of a linear layer: a uniformly quantized QuantLinear's one part, else the
    nn.Linear's weight."""
    bias = getattr(module, "bias", None)
    if isinstance(module, QuantWeights):
        qtype, rows = module.parts()[0]
        return Projection(rows.contiguous(), None if bias is None else bias.detach().float().contiguous(),
                          int(qtype), int(rows.shape[1]))
    # After the eager layers are packed for oneDNN these are the only references to the
    # row-major weights.
    return Projection(module.weight.detach().contiguous(), None if bias is None else bias.detach().contiguous())


def takes_blocks(module: nn.Module) -> bool:
    """Whether the step's kernels run `module`'s blocks: one block type over all rows, one the
    C kernels have."""
    return isinstance(module, QuantWeights) and module.is_uniform and module.qtypes[0] in QUANT_TYPES


def unsupported(model: nn.Module) -> str | None:
    """Why the step cannot run this quantized model's projections (None: it can): a layer of
    several block types, a dense part inside a quantized layer, or a dense layer in another
    dtype."""
    dtype = next(model.parameters()).dtype
    for i, layer in enumerate(model._stage()):
        for name, module in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                             ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)):
            if isinstance(module, QuantWeights):
                if not takes_blocks(module):
                    return f"layer {i}'s {name} projection is not one quantized block type ({module.extra_repr()})"
            elif not isinstance(module, nn.Linear) or module.weight.dtype != dtype:
                return f"layer {i}'s {name} projection is neither quantized nor a {dtype} linear layer"
    return None
