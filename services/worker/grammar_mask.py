"""Structured outputs on the worker: mask the logits of constrained rows with the step's
packed allowed-token bitmask (filled by the scheduler's grammar matchers) before sampling.

One batched torch op for every constrained row together; free rows are never touched.
"""

from __future__ import annotations

import numpy as np
import torch

from services.common.proto import myvllm_pb2 as pb

_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, ceil(V / 32)] int32 words -> [R, V] bool, True where the token is allowed
    (bit t % 32 of word t // 32)."""
    bits = (packed.unsqueeze(-1) >> _BITS.to(packed.device)) & 1
    return bits.reshape(packed.shape[0], -1)[:, :vocab_size].bool()


def apply_grammar_bitmask(logits: torch.Tensor, so: pb.SchedulerOutput, batch_index: dict[str, int]) -> None:
    """Set to -inf, in place, every token the grammar forbids in the constrained rows of `logits`.

    `batch_index` maps a request id to its row in `logits` (the rows that sample this step).
    """
    if not so.structured_output_request_ids:
        return
    num_rows = len(so.structured_output_request_ids)
    packed = np.frombuffer(so.grammar_bitmask, dtype="<i4").reshape(num_rows, -1)
    rows = [batch_index.get(rid, -1) for rid in so.structured_output_request_ids]
    keep = np.asarray(rows) >= 0
    if not keep.any():
        return
    index = torch.from_numpy(np.asarray(rows, dtype=np.int64)[keep]).to(logits.device)
    allowed = unpack_bitmask(torch.from_numpy(packed[keep].astype(np.int32)).to(logits.device), logits.shape[-1])
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
