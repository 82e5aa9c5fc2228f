"""Triton attention for CUDA: one KV-store kernel and one paged varlen attention kernel per layer.

`prepare` runs once per step and hands every layer the same int32, contiguous metadata
(block table, query start offsets, context lengths) plus the step's largest query length,
which picks the query tile (16 rows for decode-only steps, 64 with prefills). `forward`
stores the layer's K/V at slot_mapping, then attends over the whole ragged batch (prefill
chunks with prior context and decodes together) in one launch; see triton_kernels.py. A
decode-only step of few requests over long contexts splits each request's keys instead
(split_kv.py, chosen per layer by `split_kv.num_splits_for` from the step's longest context
and the plain kernel's number of programs).

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 (set before the kernels
module is first imported) on CPU tensors: slow, for tests only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.attention import split_kv, triton_kernels
from services.worker.attention.base import AttentionMetadata


@dataclass
class _TritonPlan:
    block_table: torch.Tensor      # [B, max_blocks] int32, contiguous rows
    query_start_loc: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor     # [B] int32
    slot_mapping: torch.Tensor     # [T] int64
    max_query_len: int
    max_seq_len: int


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, tile_n: int = 32, block_m: int | None = None, num_splits: int | None = None) -> None:
        self.tile_n = tile_n
        self.block_m = block_m  # None: per step, from the largest query length
        # Split-KV partitions for decode-only steps; None: by the rule (split_kv.num_splits_for).
        self.num_splits = num_splits
        self._num_sms: int | None = None

    def prepare(self, meta: AttentionMetadata) -> _TritonPlan:
        block_table = meta.block_table
        if block_table.dtype != torch.int32 or block_table.stride(-1) != 1:
            block_table = block_table.to(torch.int32).contiguous()
        slot_mapping = meta.slot_mapping
        if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
            slot_mapping = slot_mapping.to(torch.int64).contiguous()
        return _TritonPlan(block_table, _int32(meta.query_start_loc), _int32(meta.context_lens), slot_mapping,
                           int(meta.max_query_len), int(meta.max_seq_len))

    def splits(self, plan: _TritonPlan, num_kv_heads: int, device: torch.device) -> int:
        """Split-KV partitions for this step's layers (1: the varlen kernel): decode-only steps only."""
        if plan.max_query_len != 1:
            return 1
        if self.num_splits is not None:
            return self.num_splits
        if self._num_sms is None:
            self._num_sms = split_kv.multiprocessors(device)
        return split_kv.num_splits_for(plan.block_table.shape[0] * num_kv_heads, plan.max_seq_len, self._num_sms)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        plan: _TritonPlan = meta.backend_data
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        triton_kernels.store_kv(k, v, k_cache, v_cache, plan.slot_mapping)
        num_splits = self.splits(plan, k_cache.shape[2], q.device)
        if num_splits > 1:
            return split_kv.split_kv_decode(q, k_cache, v_cache, plan.block_table, plan.query_start_loc,
                                            plan.context_lens, scale, num_splits, tile_n=self.tile_n)
        return triton_kernels.paged_attention(
            q, k_cache, v_cache, plan.block_table, plan.query_start_loc, plan.context_lens, scale,
            plan.max_query_len, block_m=self.block_m, tile_n=self.tile_n)
