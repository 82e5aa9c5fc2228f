"""Logits processors, in the sampler's order (services/worker/sampler.py): logit_bias, the bans
(bad words, min_tokens) and the repetition / frequency / presence penalties (vLLM semantics)."""

from __future__ import annotations

import numpy as np
import torch

from services.worker.sampling_metadata import SamplingMetadata, index_tensor

_NEG_INF = float("-inf")


def apply_processors(logits: torch.Tensor, md: SamplingMetadata, inplace: bool = False) -> torch.Tensor:
    """Bad words, logit_bias, min_tokens and the penalties (returns `logits` itself if none apply).

    `inplace`: `logits` may be overwritten (the sampler's own call; saves a copy).
    The bans (bad words, min_tokens) all set -inf, and -inf + bias stays -inf, so adding
    the bias first and then one -inf scatter for every ban gives the documented order.
    """
    if not md.needs_processing:
        return logits
    x = logits if inplace else logits.clone()
    if md.logit_bias is not None:
        b, t, v = md.logit_bias
        x.index_put_((b, t), v.to(x.dtype), accumulate=True)
    bans = banned_pairs(md)
    if bans is not None:
        x.index_put_(bans, torch.tensor(_NEG_INF, dtype=x.dtype, device=x.device))
    if md.has_penalties:
        x = apply_penalties(x, md)
    return x


def apply_penalties(x: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition, frequency and presence penalties (vLLM semantics).

    On an accelerator: dense [B, vocab] tensor ops over the counts and the prompt mask.
    On CPU, where each [B, vocab] pass is costly, only the tokens a row has seen can
    change: gather the logits at the row's prompt + output tokens (read from the token
    history; padded with its first token), penalise those, scatter them back. Every such
    token is in the prompt or the output, so the repetition penalty applies to all of them;
    duplicates compute and write the same value.
    """
    st, h = md.penalty_state, md.history
    vocab = x.shape[-1]
    if md.allow_sync and h is not None and md.rows is not None:
        n = h.num_tokens[md.rows]
        width = int(n.max())
        if 0 < width < vocab // 2 and (n > 0).all():
            tok = h.token_ids[md.rows, :width].astype(np.int64)
            keep = (np.arange(width)[None, :] < n[:, None]) & (tok < vocab)
            idx = index_tensor(np.where(keep, tok, tok[:, :1]), x.device)
            vals = x.gather(1, idx)
            if md.repetition is not None:
                vals = torch.where(vals > 0, vals / md.repetition, vals * md.repetition)
            if md.frequency is not None or md.presence is not None:
                counts = st.output_counts[md.rows_t[:, None], idx]
                if md.frequency is not None:
                    vals = vals - md.frequency * counts
                if md.presence is not None:
                    vals = vals - md.presence * (counts > 0)
            return x.scatter_(1, idx, vals)
    counts = st.output_counts[md.rows_t]
    present = counts > 0
    if md.repetition is not None:
        seen = present | st.prompt_mask[md.rows_t]
        factor = torch.where(seen, md.repetition, 1.0)
        x = torch.where(x > 0, x / factor, x * factor)
    if md.frequency is not None:
        x = x - md.frequency * counts
    if md.presence is not None:
        x = x - md.presence * present
    return x


def banned_pairs(md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(batch index, token) pairs to set to -inf this step: one vectorised pass per kind."""
    parts_b, parts_t = [], []
    if md.static_bans is not None:
        parts_b.append(md.static_bans[0])
        parts_t.append(md.static_bans[1])
    h = md.history
    if md.bad_words is not None:
        bw = md.bad_words
        width = bw.prefix.shape[1]
        end = h.num_tokens[bw.rows]
        pos = end[:, None] - width + np.arange(width)[None, :]
        generated = pos >= h.num_prompt_tokens[bw.rows][:, None]  # only generated tokens count
        tokens = h.token_ids[bw.rows[:, None], np.maximum(pos, 0)]
        match = np.where(bw.care, generated & (tokens == bw.prefix), True).all(axis=1)
        if match.any():
            parts_b.append(bw.batch_index[match])
            parts_t.append(bw.last[match])
    if md.min_tokens is not None:
        mt = md.min_tokens
        num_output = h.num_tokens[mt.rows] - h.num_prompt_tokens[mt.rows]
        active = (num_output < mt.min_tokens)[mt.owner]
        if active.any():
            parts_b.append(mt.batch_index[active])
            parts_t.append(mt.token[active])
    if not parts_b:
        return None
    device = md.greedy_mask.device
    return index_tensor(np.concatenate(parts_b), device), index_tensor(np.concatenate(parts_t), device)
