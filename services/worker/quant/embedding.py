"""QuantEmbedding: a (vocabulary-parallel) embedding table kept in GGUF blocks: a lookup gathers
the tokens' rows and dequantizes only those. Tied to the LM head, the same blocks serve it
(`quant_matmul(hidden, embedding)`)."""

from __future__ import annotations

import torch

from services.worker.parallel import all_reduce, get_tp, vocab_range
from services.worker.quant.ops import dequantize_rows
from services.worker.quant.weights import QuantWeights


class QuantEmbedding(QuantWeights):
    """Each TP rank holds one vocabulary range's rows (as VocabParallelEmbedding); ids outside
    it contribute zeros and one all-reduce assembles every token's row."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32) -> None:
        self.vocab_start, rows = vocab_range(vocab_size, get_tp())
        super().__init__(hidden_size, rows)
        self.num_embeddings, self.embedding_dim = rows, hidden_size
        self.dtype = dtype  # the activations' dtype, which lookups return

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if get_tp().size == 1:
            return dequantize_rows(self, ids.reshape(-1)).to(self.dtype).reshape(*ids.shape, -1)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.num_embeddings)
        rows = dequantize_rows(self, torch.where(inside, local, 0).reshape(-1)).to(self.dtype)
        rows = rows.reshape(*ids.shape, -1)
        return all_reduce(rows * inside.unsqueeze(-1).to(rows.dtype))
