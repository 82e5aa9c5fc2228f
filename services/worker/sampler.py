"""The batched sampler: logits of the rows that sample this step → one token id each.

Order (shared/DESIGN.md §4): logprobs from the raw logits; greedy rows take the argmax;
random rows go through temperature, min_p, top_k / top_p and are drawn as
argmax(probs / q) with q ~ Exp(1), where each seeded request draws q from its own
generator (so its tokens do not depend on the batch around it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from services.common.proto import myvllm_pb2 as pb

_GREEDY_EPS = 1e-5


@dataclass
class SamplingMetadata:
    """Per-row sampling tensors for one batch composition (rebuilt only when it changes)."""

    all_greedy: bool
    greedy_mask: torch.Tensor          # [B] bool
    temperature: torch.Tensor          # [B, 1] (1.0 on greedy rows)
    top_k: torch.Tensor | None         # [B] int64, vocab size where off; None: no row uses it
    top_p: torch.Tensor | None         # [B]; None: no row uses it
    min_p: torch.Tensor | None         # [B, 1]; None: no row uses it
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # batch index → generator
    logprobs_k: np.ndarray | None = None  # [B] top-k per row (-1: none); None: no row asks


def build_sampling_metadata(params: list[pb.SamplingParams], generators: dict[int, torch.Generator],
                            vocab_size: int, device: torch.device) -> SamplingMetadata:
    temperature = np.array([p.temperature for p in params], dtype=np.float32)
    top_k = np.array([p.top_k if p.top_k > 0 else vocab_size for p in params], dtype=np.int64)
    top_p = np.array([p.top_p if 0 < p.top_p < 1 else 1.0 for p in params], dtype=np.float32)
    min_p = np.array([p.min_p for p in params], dtype=np.float32)
    greedy = (temperature < _GREEDY_EPS) | (top_k == 1)
    logprobs_k = np.array([p.logprobs for p in params], dtype=np.int64)
    random_rows = ~greedy
    return SamplingMetadata(
        all_greedy=bool(greedy.all()),
        greedy_mask=torch.from_numpy(greedy).to(device),
        temperature=torch.from_numpy(np.where(greedy, 1.0, temperature).astype(np.float32)).to(device)[:, None],
        top_k=torch.from_numpy(top_k).to(device) if (top_k[random_rows] < vocab_size).any() else None,
        top_p=torch.from_numpy(top_p).to(device) if (top_p[random_rows] < 1.0).any() else None,
        min_p=torch.from_numpy(min_p).to(device)[:, None] if (min_p[random_rows] > 0).any() else None,
        generators=generators,
        logprobs_k=logprobs_k if (logprobs_k >= 0).any() else None,
    )


class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, list | None]:
        """Returns sampled ids [B] and, if any row asked, per-row TokenLogprobs (or None)."""
        raw_logprobs = torch.log_softmax(logits, dim=-1) if md.logprobs_k is not None else None
        greedy_ids = logits.argmax(dim=-1)
        if md.all_greedy:
            sampled = greedy_ids
        else:
            random_ids = self._sample_random(logits, md)
            sampled = torch.where(md.greedy_mask, greedy_ids, random_ids)
        logprobs = self._gather_logprobs(raw_logprobs, sampled, md.logprobs_k) if raw_logprobs is not None else None
        return sampled, logprobs

    def _sample_random(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        logits = logits / md.temperature
        if md.min_p is not None:
            probs = logits.softmax(dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * md.min_p
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if md.top_p is not None:
            logits = self._top_k_top_p(logits, md.top_k, md.top_p)
        elif md.top_k is not None:
            logits = self._top_k_only(logits, md.top_k)
        probs = logits.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_()
        for row, gen in md.generators.items():
            q[row].exponential_(generator=gen)
        return probs.div_(q).argmax(dim=-1)

    @staticmethod
    def _top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
        # topk with the largest k, then each row's own k-th value as its threshold: no full sort.
        max_k = int(top_k.max())
        values = logits.topk(max_k, dim=-1).values
        kth = values.gather(1, (top_k.clamp(max=max_k) - 1)[:, None])
        return logits.masked_fill(logits < kth, float("-inf"))

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        vocab = logits.shape[-1]
        if top_k is not None:
            kth = sorted_logits.gather(1, (vocab - top_k.clamp(max=vocab))[:, None])
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p)[:, None]
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)

    @staticmethod
    def _gather_logprobs(raw: torch.Tensor, sampled: torch.Tensor, ks: np.ndarray) -> list[pb.TokenLogprobs | None]:
        max_k = int(ks.max())
        sampled_lp = raw.gather(1, sampled[:, None])
        ranks = (raw > sampled_lp).sum(dim=-1) + 1
        top_lp, top_ids = raw.topk(max_k, dim=-1) if max_k > 0 else (raw[:, :0], sampled[:, None][:, :0])
        sampled_lp, ranks = sampled_lp[:, 0].tolist(), ranks.tolist()
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
        out: list[pb.TokenLogprobs | None] = []
        for i, k in enumerate(ks.tolist()):
            if k < 0:
                out.append(None)
                continue
            out.append(pb.TokenLogprobs(logprob=sampled_lp[i], rank=ranks[i],
                                        top_ids=top_ids[i][:k], top_logprobs=top_lp[i][:k]))
        return out
