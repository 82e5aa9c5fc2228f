"""The pooling runner's pooler (vLLM's Pooler for convert "embed" on a causal LM).

A pooling request's prompt may be computed over several steps (chunked prefill). Each step the
model runner hands this module the final norm's output of every token of the step; for MEAN the
tokens of each pooling request are added into a running sum per batch row (one `index_add_`, no
per-token Python loop); for LAST only the step that computes the prompt's last token matters.
When a request's prompt is complete its vector is finished: the mean (or the last token's hidden
state), truncated to the request's `dimensions` (Matryoshka models only; checked by the engine
and at the worker boundary), then L2-normalized when the pooler config says so.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from services.common.pooling_config import PoolerConfig
from services.common.proto import myvllm_pb2 as pb


def finish_embedding(pooled: torch.Tensor, dimensions: int, normalize: bool) -> torch.Tensor:
    """[hidden] (or [n, hidden]) pooled states → the embedding: first `dimensions` values (0 = all,
    Matryoshka-style truncation), then L2-normalized if `normalize` (after the cut, so the
    truncated vector has unit norm)."""
    if dimensions:
        pooled = pooled[..., :dimensions]
    pooled = pooled.float()
    return F.normalize(pooled, p=2, dim=-1) if normalize else pooled


def embedding_bytes(embedding: torch.Tensor) -> bytes:
    """Little-endian float32, packed (the wire format of PoolerOutput / RequestOutput)."""
    return embedding.detach().float().cpu().numpy().astype("<f4").tobytes()


def embedding_from_bytes(data: bytes) -> list[float]:
    return np.frombuffer(data, dtype="<f4").tolist()


class Pooler:
    """Per-row pooling state of the persistent batch and the pooling of each step."""

    def __init__(self, config: PoolerConfig, max_num_reqs: int, hidden_size: int, device: torch.device) -> None:
        self.config = config
        self.hidden_size = hidden_size
        # MEAN: each row's sum of its prompt tokens' hidden states so far (fp32 whatever the model
        # dtype: a long prompt's sum must not lose the small terms).
        self.sums = torch.zeros((max_num_reqs, hidden_size), dtype=torch.float32, device=device) \
            if config.pooling_type == "MEAN" else None

    def start_row(self, row: int) -> None:
        """A pooling request enters `row` with nothing computed (the worker refuses otherwise)."""
        if self.sums is not None:
            self.sums[row].zero_()

    def pool(self, hidden: torch.Tensor, rows: np.ndarray, num_scheduled: np.ndarray, query_start_loc: np.ndarray,
             pooling_mask: np.ndarray, done_mask: np.ndarray, num_prompt_tokens: np.ndarray,
             dimensions: np.ndarray) -> list[tuple[int, torch.Tensor]]:
        """One step. hidden: [T, hidden] of the step's tokens (request i's at query_start_loc[i]
        ..query_start_loc[i+1]); per scheduled request i: its batch row, whether it pools, whether
        this step completes its prompt, its prompt length and requested dimensions.
        Returns (step index i, embedding) for each request whose prompt this step completed."""
        if self.sums is not None and pooling_mask.any():
            token_req = np.repeat(np.arange(rows.size), num_scheduled)
            token_sel = np.flatnonzero(pooling_mask[token_req])
            target_rows = torch.from_numpy(rows[token_req[token_sel]]).to(hidden.device)
            self.sums.index_add_(0, target_rows, hidden.index_select(0, torch.from_numpy(token_sel).to(hidden.device))
                                 .float())
        done = np.flatnonzero(pooling_mask & done_mask)
        if not done.size:
            return []
        if self.sums is not None:
            done_rows = torch.from_numpy(rows[done]).to(hidden.device)
            counts = torch.from_numpy(num_prompt_tokens[done].astype(np.float32)).to(hidden.device)
            pooled = self.sums.index_select(0, done_rows) / counts[:, None]
        else:  # LAST: the prompt's last token is the last one this step computed for the request
            last = torch.from_numpy(query_start_loc[done + 1] - 1).to(hidden.device)
            pooled = hidden.index_select(0, last).float()
        normalize = self.config.normalize
        result = []
        if not dimensions[done].any():
            finished = finish_embedding(pooled, 0, normalize)
            return [(int(i), finished[j]) for j, i in enumerate(done.tolist())]
        for j, i in enumerate(done.tolist()):
            result.append((i, finish_embedding(pooled[j], int(dimensions[i]), normalize)))
        return result


def pooler_outputs(request_ids: list[str], embeddings: list[tuple[int, torch.Tensor]]) -> list[pb.PoolerOutput]:
    return [pb.PoolerOutput(request_id=request_ids[i], embedding=embedding_bytes(e)) for i, e in embeddings]
