"""Linear layers with oneDNN-prepacked weights, for CPU workers.

`F.linear` on CPU hands a row-major [out, in] weight to the GEMM on every call, which then
re-blocks it for its vector kernels each time; for fp32 that path also goes through a generic
sgemm. Reordering each weight once into oneDNN's blocked layout and calling oneDNN's matmul on
it runs about twice as fast for fp32 at decode and prefill sizes and faster for bf16 too
(BENCHMARKS.md, "CPU kernels"), the same idea as vLLM's CPU `onednn_mm`. Works for any number of rows (no shape specialisation, nothing to compile).

The reordered copy replaces the layer's weight (the model keeps one copy of the weights);
the tied LM head gets its own reordered copy beside the embedding table it shares.

On AVX-512 CPUs fp32 weights (and bf16 ones where the CPU has AVX512_BF16, and on a CPU with AMX
where our GEMM was built with its tiles) are packed for our own GEMM instead (`cpu/gemm.c`: column blocks that stream from memory; well ahead
of oneDNN at decode sizes with each layer's own weights, level on prefill-sized batches), where the
output size is a multiple of its 32-column blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from services.common.cpu_dtype_probe import GemmTimings, probe_model
from services.worker import opaque_ops
from services.worker.cpu.gemm import PanelGemm

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def available(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack weights of `dtype` in this torch build, on this CPU: its bf16
    path needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, and refuses to reorder on an AVX2-only
    CPU (there bf16 layers stay plain torch ones)."""
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available() or not hasattr(
            torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout, or in gemm.c's (AVX-512)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        gemm = PanelGemm.load()
        self.gemm = gemm if gemm is not None and gemm.supports(weight) else None
        with torch.no_grad():
            if self.gemm is not None:
                self.packed = self.gemm.pack(weight)
            else:  # no batch-size hint: one layout serves every number of rows
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().contiguous(), requires_grad=False)
        self.opaque_index = -1  # set by opaque_ops.assign when the model is compiled

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.myvllm.packed_linear(x, self.opaque_index)
        return self.matmul(x)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm is not None:
            return self.gemm.matmul(x, self.packed, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def linear_kernel(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ weight.T as a single-rank CPU worker's linear layer computes it: packed (gemm.c or
    oneDNN) where the dtype packs, else `F.linear`. A step of a few rows runs the C decode step's
    row GEMVs instead, which stream the weights as the packed GEMM does at M=1."""
    if available(weight.dtype):
        return PackedLinear(weight, None).matmul
    return lambda x: nn.functional.linear(x, weight)


def dtype_probe(model_dir: str) -> Callable[[], GemmTimings | None]:
    """`--dtype auto`'s measurement for a CPU worker of `model_dir`: its projection's products
    timed through `linear_kernel` in fp32 and bf16 (services/common/cpu_dtype_probe.py)."""
    return lambda: probe_model(model_dir, linear_kernel)


def pack_linears(model: nn.Module) -> int:
    """Swap every `nn.Linear` of `model` for a `PackedLinear`; returns how many were swapped."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, nn.Linear)]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear.from_linear(child))
    return len(swaps)


@torch.library.custom_op("myvllm::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, index: int) -> torch.Tensor:
    """A `PackedLinear` (`opaque_ops` index) inside a compiled graph, which cannot hold its
    oneDNN weight tensor."""
    return opaque_ops.lookup(index).matmul(x)


@packed_linear.register_fake
def _(x: torch.Tensor, index: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], opaque_ops.lookup(index).out_features)
