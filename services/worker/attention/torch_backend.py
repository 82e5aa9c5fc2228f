"""Reference paged attention in plain torch: runs on any device, the oracle for kernels.

Decodes (one query token) are attended together in one batched call over their gathered
blocks; prefill chunks go one request at a time (there are few per step), with a causal
mask shifted by the context already in the cache. A short query after a context (speculative
decoding's k+1 verified positions) is split into one decode entry per token, query token j
seeing the first context + j + 1 positions: every token's K/V of the step is stored before
attention reads, so this is exact, and it keeps such rows on the decode path (a kernel's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from services.worker.attention.base import AttentionMetadata


@dataclass
class _Prefill:
    start: int
    end: int
    context_len: int
    seq_len: int
    block_ids: torch.Tensor | None  # blocks holding the whole sequence (None: no context)
    mask: torch.Tensor | None       # [q, seq_len] bool (None: plain causal)
    row: int = -1                   # the request's row of the metadata's block table


# Queries of at most this many tokens after a context attend as per-token decode entries.
SHORT_QUERY_AS_DECODES = 8


@dataclass
class _TorchPlan:
    decode_token_idx: torch.Tensor | None  # [Bd] int64
    decode_block_ids: torch.Tensor | None  # [Bd * nb] int64
    decode_num_blocks: int
    decode_mask: torch.Tensor | None       # [Bd, 1, 1, nb * block_size] bool
    prefills: list[_Prefill]
    all_decode: bool
    decode_rows: torch.Tensor | None = None         # [Bd] batch row of each decode entry
    decode_block_table: torch.Tensor | None = None  # [Bd, max_blocks] int32 (kernel backends)
    decode_seq_lens: torch.Tensor | None = None     # [Bd] int32: positions each decode entry attends to


class TorchAttentionBackend:
    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> _TorchPlan:
        device = meta.slot_mapping.device
        qsl = meta.query_start_loc_np
        query_lens = np.diff(qsl)
        seq_lens = meta.seq_lens_np
        bs = meta.block_size
        is_decode = (query_lens == 1) | ((query_lens <= SHORT_QUERY_AS_DECODES) & (meta.context_lens_np > 0))
        dec = np.flatnonzero(is_decode)
        plan = _TorchPlan(None, None, 0, None, [], bool(is_decode.all()))
        if dec.size:
            # One entry per query token of the decode rows, in token order.
            per_row = query_lens[dec]
            rows = np.repeat(dec, per_row)
            offsets = np.arange(rows.size) - np.repeat(np.cumsum(per_row) - per_row, per_row)
            entry_seq_lens = meta.context_lens_np[rows] + offsets + 1
            nb = int(-(-entry_seq_lens.max() // bs))
            rows_t = torch.from_numpy(rows).to(device)
            plan.decode_rows = rows_t
            plan.decode_seq_lens = torch.from_numpy(entry_seq_lens.astype(np.int32)).to(device)
            plan.decode_token_idx = torch.from_numpy((qsl[rows] + offsets).astype(np.int64)).to(device)
            plan.decode_block_ids = meta.block_table[rows_t, :nb].reshape(-1).long()
            plan.decode_num_blocks = nb
            key_pos = torch.arange(nb * bs, device=device)
            plan.decode_mask = (key_pos[None, :] < plan.decode_seq_lens[:, None]).view(rows.size, 1, 1, -1)
        for i in np.flatnonzero(~is_decode):
            start, end = int(qsl[i]), int(qsl[i + 1])
            ctx, seq = int(meta.context_lens_np[i]), int(seq_lens[i])
            block_ids = mask = None
            if ctx > 0:
                block_ids = meta.block_table[i, :-(-seq // bs)].long()
                q_pos = torch.arange(ctx, seq, device=device)
                mask = torch.arange(seq, device=device)[None, :] <= q_pos[:, None]
            plan.prefills.append(_Prefill(start, end, ctx, seq, block_ids, mask, int(i)))
        return plan

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        plan: _TorchPlan = meta.backend_data
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)

        out = q.new_empty(q.shape) if not plan.all_decode else None
        if plan.decode_token_idx is not None:
            dec_out = self._decode(q if plan.all_decode else q.index_select(0, plan.decode_token_idx),
                                   k_cache, v_cache, plan, scale)
            if plan.all_decode:
                return dec_out
            out.index_copy_(0, plan.decode_token_idx, dec_out)
        if plan.prefills:
            self._prefills(q, k, v, k_cache, v_cache, plan, meta, scale, out)
        return out

    def _prefills(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, plan: _TorchPlan, meta: AttentionMetadata, scale: float,
                  out: torch.Tensor) -> None:
        """Attend every prefill chunk of the step into its rows of `out` (one at a time here)."""
        for p in plan.prefills:
            out[p.start:p.end] = self._prefill(q[p.start:p.end], k[p.start:p.end], v[p.start:p.end],
                                               k_cache, v_cache, p, scale)

    @staticmethod
    def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _TorchPlan,
                scale: float) -> torch.Tensor:
        num_reqs, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        length = plan.decode_num_blocks * k_cache.shape[1]
        # [Bd*nb, bs, KVH, D] → [Bd, KVH, L, D] (a view; SDPA reads it strided)
        keys = k_cache.index_select(0, plan.decode_block_ids).view(num_reqs, length, num_kv_heads, head_dim)
        values = v_cache.index_select(0, plan.decode_block_ids).view(num_reqs, length, num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=plan.decode_mask, scale=scale, enable_gqa=num_heads != num_kv_heads)
        return out.squeeze(2)

    @staticmethod
    def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, p: _Prefill, scale: float) -> torch.Tensor:
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        if p.block_ids is not None:
            # Earlier chunks / prefix-cache hits live only in the cache: read the whole sequence.
            k = k_cache.index_select(0, p.block_ids).flatten(0, 1)[:p.seq_len]
            v = v_cache.index_select(0, p.block_ids).flatten(0, 1)[:p.seq_len]
        # 4-D inputs: with 3-D ones CPU SDPA falls back to its slow math path (an order of magnitude slower).
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=p.mask, is_causal=p.mask is None, scale=scale,
            enable_gqa=num_heads != num_kv_heads)
        return out[0].transpose(0, 1)
