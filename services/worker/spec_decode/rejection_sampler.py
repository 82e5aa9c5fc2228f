"""Exact verification of draft tokens, batched over requests and positions.

Request r brought d_r drafts; the target model scored all d_r + 1 positions in one forward.
Position j accepts its draft x when, for a greedy row, x is the target's argmax, and for a
random row with probability min(1, p_target(x) / p_draft(x)) (an n-gram draft is a point
mass: p_draft(x) = 1). The first refused position emits a token drawn from the normalised
positive part of p_target - p_draft (the "recovered" token); when every draft is accepted the
last position emits a token drawn from p_target (the "bonus" token). This is the standard
speculative sampling scheme (Leviathan et al., Chen et al.): every emitted token has exactly
the target's distribution given the tokens before it.

Layout: the target's per-position results are flat, request r's rows at
`starts[r] .. starts[r] + d_r`, and are viewed as a padded [R, K+1] grid for the
accept/refuse logic (positions past d_r are masked).
"""

from __future__ import annotations

import numpy as np
import torch

from services.worker.exponential import exponential_like


def rejection_sample(
    target_argmax: torch.Tensor,
    target_probs: torch.Tensor | None,
    num_draft: np.ndarray,
    draft_ids: torch.Tensor,
    greedy: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens [R, K+1], padded with -1; num_tokens [R] = accepted drafts + 1).

    target_argmax: [M] argmax of each flat position's processed logits (greedy rows use it);
    target_probs: [M, V] the distribution each random row draws from at that position (None:
    every row is greedy); num_draft: [R] drafts per request (M = sum(num_draft + 1));
    draft_ids: [R, K] drafts, padded; greedy: [R] bool; draft_probs: [R, K, V] the draft
    model's distributions (None: point masses, as the n-gram proposer's).
    """
    dev = target_argmax.device
    num_reqs, k = draft_ids.shape
    nd = torch.from_numpy(np.asarray(num_draft, dtype=np.int64)).to(dev)
    starts = torch.from_numpy(np.concatenate([[0], np.cumsum(np.asarray(num_draft) + 1)[:-1]]).astype(np.int64)).to(dev)
    pos = torch.arange(k + 1, device=dev)
    flat = (starts[:, None] + pos[None, :]).clamp(max=target_argmax.numel() - 1)  # [R, K+1]
    is_draft = pos[None, :k] < nd[:, None]                                        # [R, K]
    # What each position emits if it is reached and refuses its draft (or is the bonus position).
    emitted = target_argmax[flat]
    accepted = draft_ids == emitted[:, :k]
    random_rows = torch.nonzero(~greedy)[:, 0]
    if target_probs is not None and random_rows.numel():
        rflat, rdraft = flat[random_rows], draft_ids[random_rows].clamp(min=0)
        p_t = target_probs[rflat].float()                                         # [Rr, K+1, V]
        pt_x = p_t[:, :k].gather(2, rdraft[..., None])[..., 0]                   # p_target(draft)
        p_d = torch.zeros_like(p_t)
        if draft_probs is None:
            p_d[:, :k].scatter_(2, rdraft[..., None], 1.0)
            pd_x = torch.ones_like(pt_x)
        else:
            p_d[:, :k] = draft_probs[random_rows].float()
            pd_x = p_d[:, :k].gather(2, rdraft[..., None])[..., 0]
        p_d[:, :k] *= is_draft[random_rows][..., None]  # the bonus position draws from p_target itself
        residual = (p_t - p_d).clamp_min_(0.0)
        # All-zero residual: p_target <= p_draft nowhere, i.e. the draft is accepted surely; any row works.
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, p_t, residual)
        # A draw from the (unnormalised) residual: argmax(w / q), q ~ Exp(1).
        emitted[random_rows] = residual.div_(exponential_like(residual)).argmax(dim=-1)
        u = torch.rand(pt_x.shape, device=dev)
        accepted[random_rows] = u * pd_x < pt_x
    accepted &= is_draft
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)                      # [R]
    padded = torch.cat([draft_ids, torch.full((num_reqs, 1), -1, dtype=draft_ids.dtype, device=dev)], dim=1)
    tokens = torch.where(pos[None, :] < num_accepted[:, None], padded, torch.full_like(padded, -1))
    tokens.scatter_(1, num_accepted[:, None], emitted.gather(1, num_accepted[:, None]).to(tokens.dtype))
    return tokens, num_accepted + 1
