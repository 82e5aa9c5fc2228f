"""The worker's persistent batch: one row per live request, updated from scheduler deltas.

Rows live across steps, so a decode step only touches what changed (a new block id, the
computed-token counter) instead of re-sending each request's history.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import torch

from services.common.proto import myvllm_pb2 as pb


def position_seed(seed: int, output_index: int) -> int:
    """The generator seed for a seeded request's `output_index`-th output token.

    A function of the position alone (not of how many numbers earlier draws consumed, which
    depends on the sampling path), so a request that resumes after a preemption or a
    migration, its earlier outputs recomputed, continues with exactly the random stream it
    would have had."""
    digest = hashlib.blake2b(struct.pack("<qq", seed, output_index), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def runs_own_counts(data: pb.CachedRequestData) -> bool:
    """Whether a cached row runs from this worker's counts, not the scheduler's (async scheduling
    with speculative decoding: the scheduler's are upper bounds while a step is in flight)."""
    return bool(data.num_worker_drafts or data.drafts_in_flight)


class InputBatch:
    """Token ids, block tables and sampling settings of every live request, by row."""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, seed: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, self.max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # Speculative decoding: drafts scheduled this step, stored after the row's known tokens
        # (token_ids[row, num_tokens:num_tokens + num_spec]) but not counted in num_tokens.
        self.num_spec = np.zeros(max_num_reqs, dtype=np.int64)
        # Drafts this worker proposed after the row's last sampled token, stored in the same place:
        # the next step verifies them when the scheduler could not know them (num_worker_drafts).
        self.num_own_drafts = np.zeros(max_num_reqs, dtype=np.int64)
        self.sampling: list[pb.SamplingParams | None] = [None] * max_num_reqs
        self.generators: dict[int, torch.Generator] = {}
        self.req_id_to_row: dict[str, int] = {}
        self.row_req_ids: list[str | None] = [None] * max_num_reqs
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.prompt_logprob_rows: set[int] = set()  # rows whose requests asked for prompt logprobs
        # Pooling runner: rows of pooling requests (they sample nothing; pooled when the prompt is
        # done) and the dimensions each asked for (0 = all).
        self.is_pooling = np.zeros(max_num_reqs, dtype=bool)
        self.pooling_dimensions = np.zeros(max_num_reqs, dtype=np.int64)
        # LoRA: the adapter slot each row runs with (-1: the base model alone).
        self.lora_slot = np.full(max_num_reqs, -1, dtype=np.int32)
        self.version = 0  # bumped whenever membership changes (invalidates cached metadata)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.req_id_to_row)

    def add(self, data: pb.NewRequestData) -> int:
        if data.request_id in self.req_id_to_row:
            self.remove(data.request_id)
        if not self.free_rows:
            raise RuntimeError(f"more than max_num_seqs={self.max_num_reqs} requests in the batch")
        row = self.free_rows.pop()
        self.version += 1
        self.req_id_to_row[data.request_id] = row
        self.row_req_ids[row] = data.request_id
        prompt = np.asarray(data.prompt_token_ids, dtype=np.int32)
        outputs = np.asarray(data.output_token_ids, dtype=np.int32)
        n = prompt.size + outputs.size
        if n > self.max_model_len:
            raise ValueError(f"request {data.request_id} has {n} tokens > max_model_len {self.max_model_len}")
        self.token_ids[row, :prompt.size] = prompt
        self.token_ids[row, prompt.size:n] = outputs
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = prompt.size
        blocks = np.asarray(data.block_ids, dtype=np.int32)
        self.block_table[row, :blocks.size] = blocks
        self.num_blocks[row] = blocks.size
        self.num_computed_tokens[row] = data.num_computed_tokens
        self.num_spec[row] = 0
        self.num_own_drafts[row] = 0
        self.sampling[row] = data.sampling
        self.is_pooling[row] = data.HasField("pooling")
        self.pooling_dimensions[row] = data.pooling.dimensions
        self.lora_slot[row] = data.lora_slot if data.HasField("lora_request") else -1
        if data.sampling.HasField("seed"):
            # A request's own generator: seeded outputs do not depend on the batch around them.
            gen = torch.Generator()
            gen.manual_seed(data.sampling.seed)
            self.generators[row] = gen
        else:
            self.generators.pop(row, None)
        if data.sampling.HasField("prompt_logprobs"):
            self.prompt_logprob_rows.add(row)
        else:
            self.prompt_logprob_rows.discard(row)
        return row

    def update(self, data: pb.CachedRequestData) -> int:
        row = self.req_id_to_row[data.request_id]
        if data.new_block_ids:
            blocks = np.asarray(data.new_block_ids, dtype=np.int32)
            start = self.num_blocks[row]
            self.block_table[row, start:start + blocks.size] = blocks
            self.num_blocks[row] = start + blocks.size
        if runs_own_counts(data):
            self.num_computed_tokens[row], self.num_spec[row] = self.own_counts(row, data.num_worker_drafts)
            return row
        self.num_computed_tokens[row] = data.num_computed_tokens
        if data.new_token_ids:
            # Pipeline parallelism: tokens another stage sampled, handed back by the scheduler.
            end = data.num_computed_tokens + len(data.new_token_ids)
            self.token_ids[row, data.num_computed_tokens:end] = data.new_token_ids
            self.num_tokens[row] = max(self.num_tokens[row], end)
        n, k = self.num_tokens[row], len(data.spec_token_ids)
        self.token_ids[row, n:n + k] = data.spec_token_ids
        self.num_spec[row] = k
        return row

    def reseed_generators(self, rows: np.ndarray) -> None:
        """Before sampling: point each seeded row's generator at the output position it samples."""
        for row in rows.tolist():
            gen = self.generators.get(row)
            if gen is not None:
                gen.manual_seed(position_seed(self.sampling[row].seed,
                                              int(self.num_tokens[row] - self.num_prompt_tokens[row])))

    def remove(self, request_id: str) -> None:
        row = self.req_id_to_row.pop(request_id, None)
        if row is None:
            return
        self.sampling[row] = None
        self.row_req_ids[row] = None
        self.generators.pop(row, None)
        self.prompt_logprob_rows.discard(row)
        self.free_rows.append(row)
        self.version += 1

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Write each row's newly sampled token after its last one."""
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1
        self.num_own_drafts[rows] = 0

    def append_token_lists(self, rows: list[int], token_lists: list[list[int]]) -> None:
        """Speculative decoding: each row's emitted tokens (accepted drafts + one) after its last one."""
        for row, tokens in zip(rows, token_lists, strict=True):
            n = self.num_tokens[row]
            self.token_ids[row, n:n + len(tokens)] = tokens
            self.num_tokens[row] = n + len(tokens)
        self.num_own_drafts[rows] = 0

    def own_counts(self, row: int, num_worker_drafts: int) -> tuple[int, int]:
        """(computed tokens, drafts to verify) of a row that runs from its own counts: the previous
        step sampled, so every token but the last is computed, and the drafts verified are (up to
        num_worker_drafts of) those proposed after it, already in place."""
        return int(self.num_tokens[row]) - 1, min(num_worker_drafts, int(self.num_own_drafts[row]))

    def set_own_drafts(self, row: int, drafts: list[int]) -> None:
        """Keep the drafts just proposed for `row` after its last token (see num_own_drafts)."""
        n = self.num_tokens[row]
        drafts = drafts[:max(self.max_model_len - n, 0)]  # (the scheduler never asks past max_model_len)
        self.token_ids[row, n:n + len(drafts)] = drafts
        self.num_own_drafts[row] = len(drafts)
