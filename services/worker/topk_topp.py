"""Random rows' distributions and draws: temperature, min_p, top-k / top-p on one of three paths
("candidates", "prefilter", "full": services/worker/sampler.py explains the choice), then
`argmax(probs / q)` with q ~ Exp(1), a seeded row's q from its own generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.exponential import exponential_
from services.worker.sampling_metadata import RandomGroup, SamplingMetadata

# The prefilter must hold at least top_p + this much mass (float slack at the boundary).
_PREFILTER_MARGIN = 1e-4

_NEG_INF = float("-inf")


@dataclass
class Dist:
    """Final (unnormalised) probabilities of some random rows, over candidates or the vocab."""

    index: torch.Tensor                  # [G'] batch indices
    probs: torch.Tensor                  # [G', K]
    ids: torch.Tensor | None             # [G', K] token ids of the columns; None: column = token id
    generators: dict[int, torch.Generator]
    draw_k: list[int] | None = None      # per-row draw size of seeded rows (None: K)


def random_dists(logits: torch.Tensor, md: SamplingMetadata) -> list[Dist]:
    dists: list[Dist] = []
    for g in md.groups:
        x = logits if g.whole else logits[g.index]
        if g.kind == "candidates":
            dists.append(candidates(x, g))
        elif g.kind == "prefilter":
            dists.extend(prefilter(x, g))
        else:
            dists.append(full(x, g))
    return dists


def filter_sorted(probs: torch.Tensor, min_p: torch.Tensor | None, top_p: torch.Tensor | None,
                   normalised: bool = False) -> torch.Tensor:
    """min_p then top_p on probabilities sorted in descending order (zeros where cut).

    `normalised`: the probabilities are already those of the whole distribution (the
    prefilter's), not to be renormalised over the columns before top_p.
    """
    if min_p is not None:
        probs = probs.masked_fill(probs < probs[:, :1] * min_p, 0.0)
    if top_p is not None:
        if not normalised:
            probs = probs / probs.sum(dim=-1, keepdim=True)
        # keep a token while the mass strictly above it is < top_p (the first always stays)
        above = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(above >= top_p, 0.0)
    return probs


def candidates(x: torch.Tensor, g: RandomGroup) -> Dist:
    values, ids = x.topk(g.max_k, dim=-1)
    values = values / g.temperature
    if g.k_mask is not None:
        values = values.masked_fill(g.k_mask, _NEG_INF)
    probs = filter_sorted(values.softmax(dim=-1), g.min_p, g.top_p)
    return Dist(g.index, probs, ids, g.generators, g.draw_k)


def prefilter(x: torch.Tensor, g: RandomGroup) -> list[Dist]:
    scaled = x / g.temperature
    values, ids = scaled.topk(g.max_k, dim=-1)
    probs = (values - torch.logsumexp(scaled, dim=-1, keepdim=True)).exp()  # under the full softmax
    inside = probs.sum(dim=-1) >= g.top_p[:, 0] + _PREFILTER_MARGIN
    if bool(inside.all()):
        return [Dist(g.index, filter_sorted(probs, None, g.top_p, normalised=True), ids, g.generators)]
    sel = torch.nonzero(inside)[:, 0]
    rest = torch.nonzero(~inside)[:, 0]
    out = []
    sel_l, rest_l = sel.tolist(), rest.tolist()
    if sel_l:
        gens = {j: g.generators[i] for j, i in enumerate(sel_l) if i in g.generators}
        kept = filter_sorted(probs[sel], None, g.top_p[sel], normalised=True)
        out.append(Dist(g.index[sel], kept, ids[sel], gens))
    gens = {j: g.generators[i] for j, i in enumerate(rest_l) if i in g.generators}
    rest_group = RandomGroup(kind="full", index=g.index[rest], whole=False, temperature=g.temperature[rest],
                              top_p=g.top_p[rest], generators=gens)
    out.append(full(x[rest], rest_group))
    return out


def full(x: torch.Tensor, g: RandomGroup) -> Dist:
    x = x / g.temperature
    if g.min_p is not None:
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * g.min_p, _NEG_INF)
    if g.top_p is not None:
        x = top_k_top_p(x, g.top_k, g.top_p[:, 0])
    elif g.top_k is not None:
        x = top_k_only(x, g.top_k, g.max_k)
    return Dist(g.index, x.softmax(dim=-1), None, g.generators)


def draw(dist: Dist) -> torch.Tensor:
    """argmax(probs / q), q ~ Exp(1); a seeded row draws its q from its own generator."""
    probs = dist.probs
    q = torch.empty_like(probs)
    if len(dist.generators) < probs.shape[0]:
        exponential_(q)
    elif dist.draw_k is not None:
        q.fill_(1.0)  # columns past a seeded row's own k have probability 0: any q > 0 will do
    for i, gen in dist.generators.items():
        k = dist.draw_k[i] if dist.draw_k is not None else probs.shape[1]
        if gen.device == q.device:
            exponential_(q[i, :k], gen)
        else:
            q[i, :k] = exponential_(torch.empty(k, dtype=q.dtype, device=gen.device), gen).to(q.device)
    choice = probs.div_(q).argmax(dim=-1)
    return choice if dist.ids is None else dist.ids.gather(1, choice[:, None])[:, 0]


def top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    # topk with the largest k in use, then each row's own k-th value as its threshold: no
    # full sort. Rows without top_k (k = vocab) keep everything.
    values = logits.topk(max_k, dim=-1).values
    kth = values.gather(1, (top_k.clamp(max=max_k) - 1)[:, None])
    kth = kth.masked_fill((top_k >= logits.shape[-1])[:, None], _NEG_INF)
    return logits.masked_fill(logits < kth, _NEG_INF)


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(max=vocab))[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - top_p)[:, None]
    drop[:, -1] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
