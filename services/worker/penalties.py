"""Penalty state of the persistent batch: per-row output-token counts and prompt-token
presence on the device, which the repetition, frequency and presence penalties read
(services/worker/logits_processors.py applies them)."""

from __future__ import annotations

import numpy as np
import torch

from services.common.proto import myvllm_pb2 as pb


def uses_penalties(sp: pb.SamplingParams) -> bool:
    return (sp.repetition_penalty not in (0.0, 1.0)) or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0


class PenaltyState:
    """Output-token counts and prompt-token presence per persistent-batch row, on the device.

    Allocated on the first request that uses a penalty (256 × 49152 × (4 + 1) bytes ≈ 60 MB).
    Rows of requests without penalties are not initialised and may hold stale values: their
    penalties are neutral (1, 0, 0), which makes any value harmless.
    """

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device | str) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.output_counts: torch.Tensor | None = None  # [max_num_reqs, vocab] int32
        self.prompt_mask: torch.Tensor | None = None    # [max_num_reqs, vocab] bool

    @property
    def allocated(self) -> bool:
        return self.output_counts is not None

    def _allocate(self) -> None:
        if self.output_counts is None:
            shape = (self.max_num_reqs, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)

    def _ids(self, ids) -> torch.Tensor:
        t = torch.from_numpy(np.asarray(list(ids), dtype=np.int64))
        t = t[(t >= 0) & (t < self.vocab_size)]
        return t.to(self.device)

    def add_request(self, row: int, data: pb.NewRequestData) -> None:
        """(Re)initialise `row` for a newly added request (a no-op for one without penalties)."""
        if not uses_penalties(data.sampling):
            return
        self._allocate()
        counts, mask = self.output_counts[row], self.prompt_mask[row]
        counts.zero_()
        mask.zero_()
        if data.output_token_ids:
            ids = self._ids(data.output_token_ids)
            counts.index_put_((ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
        if data.prompt_token_ids:
            mask[self._ids(data.prompt_token_ids)] = True

    def update(self, rows: torch.Tensor, sampled: torch.Tensor, ones: torch.Tensor) -> None:
        """Count this step's sampled tokens (one scatter-add for the whole batch)."""
        self.output_counts.index_put_((rows, sampled), ones, accumulate=True)
