"""QuantLinear: a linear layer whose weight stays in GGUF blocks (forward through ops.py)."""

from __future__ import annotations

import torch
from torch import nn

from services.worker.parallel import all_reduce, get_tp
from services.worker.quant.ops import quant_matmul
from services.worker.quant.weights import QuantWeights


class QuantLinear(QuantWeights):
    """y = x W^T + b with W in quantized parts. `row_parallel`: the input columns are split
    across TP ranks (as RowParallelLinear): the partial products are all-reduced, then the
    replicated bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, row_parallel: bool = False) -> None:
        super().__init__(in_features, out_features)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.row_parallel = row_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_parallel and get_tp().size > 1:
            y = all_reduce(quant_matmul(x, self))
            return y if self.bias is None else y + self.bias
        return quant_matmul(x, self, self.bias)
