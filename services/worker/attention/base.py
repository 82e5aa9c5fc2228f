"""The attention interface: per-step metadata, the forward context and the layer module.

The model runner builds one `AttentionMetadata` per step (flat ragged batch: every
request's scheduled tokens back to back) and sets it as the forward context; each
`AttentionLayer` then stores its K/V into the paged cache at `slot_mapping` and attends
through the selected backend. A backend is one file in this package implementing
`AttentionBackend`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from services.worker import opaque_ops


@dataclass
class AttentionMetadata:
    """One step's ragged batch, as attention needs it. Tensors are on the model's device."""

    num_tokens: int
    slot_mapping: torch.Tensor     # [T] int64: flat slot of each token's K/V
    query_start_loc: torch.Tensor  # [B+1] int32: token offset of each request
    seq_lens: torch.Tensor         # [B] int32: context + this step's tokens
    context_lens: torch.Tensor     # [B] int32: tokens already in the cache before this step
    block_table: torch.Tensor      # [B, max_blocks] int32 (unused entries 0 = null block)
    max_query_len: int
    max_seq_len: int
    block_size: int
    # The same numbers on the host, for backends that plan per-request work there.
    query_start_loc_np: np.ndarray = field(repr=False, default=None)
    seq_lens_np: np.ndarray = field(repr=False, default=None)
    context_lens_np: np.ndarray = field(repr=False, default=None)
    # Whatever the backend derived once per step (shared by every layer).
    backend_data: Any = None
    # LoRA: which adapter slot each token runs with (services/worker/lora/apply.py LoraBatch);
    # None when no token of the step uses an adapter.
    lora: Any = None

    @classmethod
    def from_host(cls, slot_mapping: np.ndarray, query_start_loc: np.ndarray, seq_lens: np.ndarray,
                  context_lens: np.ndarray, block_table: np.ndarray, block_size: int,
                  device: torch.device | str) -> AttentionMetadata:
        """Build from the host arrays: device copies in the dtypes above, the host ones kept."""
        return cls(
            num_tokens=len(slot_mapping),
            slot_mapping=torch.from_numpy(np.ascontiguousarray(slot_mapping, dtype=np.int64)).to(device),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
            context_lens=torch.from_numpy(context_lens.astype(np.int32)).to(device),
            block_table=torch.from_numpy(np.ascontiguousarray(block_table)).to(device),
            max_query_len=int(np.diff(query_start_loc).max()),
            max_seq_len=int(seq_lens.max()),
            block_size=block_size,
            query_start_loc_np=query_start_loc,
            seq_lens_np=seq_lens,
            context_lens_np=context_lens,
        )


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata) -> Any:
        """Derive per-step data once for all layers (stored in meta.backend_data)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Store k/v at meta.slot_mapping, then attend: q [T, H, D] → [T, H, D].

        kv_cache is [2, num_blocks, block_size, num_kv_heads, head_dim].
        """


_forward_context: tuple[AttentionBackend, AttentionMetadata] | None = None


@contextlib.contextmanager
def forward_context(backend: AttentionBackend, meta: AttentionMetadata) -> Iterator[None]:
    """Make `meta` visible to every AttentionLayer for one forward pass."""
    global _forward_context
    previous = _forward_context
    _forward_context = (backend, meta)
    try:
        yield
    finally:
        _forward_context = previous


def current_metadata() -> AttentionMetadata | None:
    """The metadata of the forward pass running now (None outside one)."""
    return None if _forward_context is None else _forward_context[1]


class AttentionLayer(nn.Module):
    """One layer's paged attention; its KV cache tensor is bound by the model runner."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.kv_cache: torch.Tensor | None = None
        self.opaque_index = -1  # set by opaque_ops.assign when the model is compiled

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # torch.compile traces around attention: the backends read host metadata, plan per
            # request and call a C kernel through ctypes, none of which inductor can trace.
            return torch.ops.myvllm.paged_attention(q, k, v, self.opaque_index)
        return self._attend(q, k, v)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if _forward_context is None or self.kv_cache is None:
            raise RuntimeError("attention called outside a forward context or before the KV cache exists")
        backend, meta = _forward_context
        return backend.forward(q, k, v, self.kv_cache, meta, self.scale)


@torch.library.custom_op("myvllm::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: int) -> torch.Tensor:
    """Attention of one layer (`opaque_ops` index) as an op inductor does not look into. It also
    writes k/v into the layer's paged cache, a side effect the graph need not order: only this
    layer's op touches that cache, and its output (which the graph uses) comes after the write."""
    return opaque_ops.lookup(index)._attend(q, k, v)


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: int) -> torch.Tensor:
    return torch.empty_like(q)
