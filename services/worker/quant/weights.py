"""Raw quantized weight rows held by a module, in parts of one GGUF type each.

A fused projection (q/k/v, gate/up) can mix block types: a llama.cpp Q4_K_M file keeps v in
Q6_K beside Q4_K q and k. Each part covers consecutive output rows; adjacent parts of one type
are merged, so a uniformly quantized layer holds one uint8 [out, row_bytes] buffer. A dense part
(F32/F16/BF16 rows in an otherwise quantized layer) keeps its float rows.
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.quant import DENSE_TYPES


class QuantWeights(nn.Module):
    """Base of the quantized modules: `in_features` inputs, `out_features` rows in `parts()`."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.qtypes: list[int] = []

    def set_parts(self, parts: list[tuple[int, torch.Tensor]]) -> None:
        """Hold `parts` ((GGUF type, rows), in output-row order) as buffers, replacing any held."""
        merged: list[tuple[int, torch.Tensor]] = []
        for qtype, rows in parts:
            if merged and merged[-1][0] == qtype:
                merged[-1] = (qtype, torch.cat((merged[-1][1], rows)))
            else:
                merged.append((qtype, rows))
        total = sum(rows.shape[0] for _, rows in merged)
        if total != self.out_features:
            raise ValueError(f"quantized parts hold {total} rows, the layer has {self.out_features}")
        for i in range(len(self.qtypes)):
            delattr(self, f"qweight{i}")
        self.qtypes = [int(qtype) for qtype, _ in merged]
        for i, (_, rows) in enumerate(merged):
            self.register_buffer(f"qweight{i}", rows.contiguous())

    def parts(self) -> list[tuple[int, torch.Tensor]]:
        """(GGUF type, rows) of each part, in output-row order."""
        return [(qtype, getattr(self, f"qweight{i}")) for i, qtype in enumerate(self.qtypes)]

    @property
    def is_uniform(self) -> bool:
        """One block type over all rows (what the fused kernels take)."""
        return len(self.qtypes) == 1 and self.qtypes[0] not in DENSE_TYPES

    def weight_bytes(self) -> int:
        return sum(rows.numel() * rows.element_size() for _, rows in self.parts())

    def extra_repr(self) -> str:
        from gguf import GGMLQuantizationType

        types = "+".join(GGMLQuantizationType(q).name for q in self.qtypes)
        return f"in_features={self.in_features}, out_features={self.out_features}, types={types}"
