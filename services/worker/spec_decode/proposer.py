"""The worker's proposer: after each step's sampling, drafts for the rows that may speculate,
returned with the step's output (the scheduler schedules them next step).

One subclass per method; `services/worker/spec_decode/factory.py` picks it from the LoadModel's
speculative_config. A proposer sees the target's runner only through `TargetRunner`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from services.common.proto import myvllm_pb2 as pb
from services.common.spec_config import SpeculativeConfig, may_speculate
from services.worker.attention.base import AttentionBackend, AttentionMetadata
from services.worker.input_batch import InputBatch
from services.worker.sampler import Sampler
from services.worker.spec_decode.ngram_proposer import NgramProposer


class TargetRunner(Protocol):
    """What a proposer reads of the target model's runner (services/worker/model_runner.py)."""

    dtype: torch.dtype
    device: torch.device
    seed: int
    vocab_size: int
    block_size: int
    eos_token_ids: list[int]
    input_batch: InputBatch
    attn_backend: AttentionBackend
    sampler: Sampler


class SpecProposer:
    """Base: which rows get drafts, and how they travel in the step's output."""

    def __init__(self, config: SpeculativeConfig, runner: TargetRunner) -> None:
        self.config = config
        self.runner = runner

    def kv_bytes_per_block(self, block_size: int) -> int:
        """KV bytes the proposer adds per block (a draft model's own cache)."""
        return 0

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the proposer's own KV cache, under the target's block ids."""

    def observe_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                     hidden: torch.Tensor) -> None:
        """Called after every target forward (a draft model mirrors it to fill its own KV)."""

    def draft_probs(self, rows: np.ndarray, num_draft: np.ndarray) -> torch.Tensor | None:
        """[R, K, V] distributions the drafts of `rows` were drawn from (None: point masses)."""
        return None

    def propose_rows(self, rows: list[int]) -> list[list[int]]:
        raise NotImplementedError

    def propose(self, out: pb.ModelRunnerOutput, sample_rows: np.ndarray) -> None:
        """Fill `out.spec_token_ids` (parallel to out.request_ids) for the rows that sampled."""
        batch = self.runner.input_batch
        rows = [r for r in sample_rows.tolist()
                if may_speculate(batch.sampling[r], int(batch.num_tokens[r] - batch.num_prompt_tokens[r]))]
        if not rows:
            return
        drafts = self.propose_rows(rows)
        if not any(drafts):
            return
        for row, d in zip(rows, drafts, strict=True):
            batch.set_own_drafts(row, d)  # (verified next step if the scheduler asks for them blind)
        by_id = {batch.row_req_ids[r]: d for r, d in zip(rows, drafts, strict=True)}
        out.spec_token_ids.extend(pb.TokenIds(ids=by_id.get(rid, ())) for rid in out.request_ids)


class NgramSpecProposer(SpecProposer):
    def __init__(self, config: SpeculativeConfig, runner: TargetRunner) -> None:
        super().__init__(config, runner)
        self.ngram = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)

    def propose_rows(self, rows: list[int]) -> list[list[int]]:
        batch = self.runner.input_batch
        return self.ngram.propose(batch.token_ids, batch.num_tokens, rows)
