"""The batched sampler: logits of the rows that sample this step → one token id each.

Order (vLLM's), every stage batched on tensors and skipped when no row needs it:

1. logprobs (and top logprobs) from the RAW logits, if any row asked;
2. bad words: a 1-token bad word is always banned; a longer one bans its last token when
   the request's last len-1 *generated* tokens equal its prefix;
3. logit_bias (added per token);
4. min_tokens: while a request has generated fewer than min_tokens tokens its EOS ids
   (unless ignore_eos) and stop_token_ids are banned;
5. penalties, vLLM semantics: repetition (tokens in the prompt or the output: logits > 0
   divided by the penalty, logits <= 0 multiplied), frequency (minus penalty × the token's
   count in the output), presence (minus penalty × 1[token in the output]);
6. greedy rows take the argmax of those processed logits;
7. random rows: temperature, min_p, top_k / top_p, then a draw `argmax(probs / q)` with
   `q ~ Exp(1)`; a seeded request draws its q from its own generator, so its tokens do not
   depend on the batch around it.

Random rows go one of three ways, chosen from each row's own parameters (so a seeded row
takes the same way whatever the batch):

- "candidates": 1 < top_k <= max_top_k. `topk(k)` of the logits, then temperature, min_p,
  the k-th cut and top_p all act on those k sorted candidates only, and q has k entries.
  (min_p and top_k both drop a lowest-logit set, so they commute.)
- "prefilter" (CPU only, top_p < 1 without top_k or min_p): the top `top_p_prefilter` tokens
  with their probabilities under the full softmax; when they hold at least top_p of the
  mass the nucleus lies inside them, otherwise that row falls back to the full sort. (The
  check reads the tensor back, which costs nothing on CPU; on an accelerator it would be a
  sync, so there every such row takes the full sort.)
- "full": the whole vocabulary; rows with top_p sort it (with their top_k, if larger than
  max_top_k), the others (plain temperature / min_p / a large top_k) do not.

Everything that depends only on the batch membership (the per-row parameter tensors, the
logit_bias index tensors, the EOS/stop pairs of min_tokens rows, the padded bad-word
prefixes, the row groups) is built in `build_sampling_metadata` and cached by the model
runner until the membership changes. Penalties read a device tensor of output-token counts
[max_num_reqs, vocab] and a prompt-presence mask [max_num_reqs, vocab] (`PenaltyState`),
allocated on the first request that uses a penalty, initialised for a row when its request
is added (from its output tokens when it resumes after a preemption) and updated with each
step's sampled tokens by one `index_put_`. On CPU the penalties only touch the tokens each
row has seen (its prompt + output tokens, gathered from the token history) instead of
making [B, vocab] passes.

Where each part lives: `sampling_metadata.py` (the per-composition tensors and row groups),
`logits_processors.py` (stages 2-5), `penalties.py` (the penalty state), `topk_topp.py` (the
random rows' paths and the draw); this module runs them in order.
"""

from __future__ import annotations

import numpy as np
import torch

from services.common.proto import myvllm_pb2 as pb
from services.worker.cpu.cpu_ops import CpuOps
from services.worker.logits_processors import apply_processors
from services.worker.penalties import PenaltyState
from services.worker.sampling_metadata import SamplingMetadata
from services.worker.topk_topp import draw, random_dists

_NEG_INF = float("-inf")


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first index on ties as argmax's (the first NaN's where a row holds
    one): on CPU the fused ops' C kernel, ~10x faster than torch.max over a vocabulary of
    logits; elsewhere torch.max's indices (CPU torch's argmax is slower still, in bf16 most)."""
    if logits.dim() == 2 and logits.stride(-1) == 1 and CpuOps.supports(logits):
        ops = CpuOps.load()
        if ops is not None:
            return ops.argmax(logits)
    return torch.max(logits, dim=-1).indices


class Sampler:
    def __init__(self, max_num_reqs: int = 256, vocab_size: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.penalty_state = PenaltyState(max_num_reqs, vocab_size, device) if vocab_size else None

    def add_requests(self, rows: list[int], requests: list[pb.NewRequestData]) -> None:
        """Initialise the per-row penalty state of newly added requests."""
        if self.penalty_state is None:
            return
        for row, data in zip(rows, requests, strict=True):
            self.penalty_state.add_request(row, data)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, list | None]:
        """Returns sampled ids [B] and, if any row asked, per-row TokenLogprobs (or None).

        `logits` may be overwritten (as in vLLM): pass a copy to keep them.
        """
        raw_logprobs = torch.log_softmax(logits, dim=-1) if md.logprobs_k is not None else None
        logits = apply_processors(logits, md, inplace=True)
        if md.all_greedy:
            sampled = greedy_ids(logits)
        else:
            sampled = greedy_ids(logits) if md.any_greedy else None
            for dist in random_dists(logits, md):
                ids = draw(dist)
                if sampled is None and dist.index.numel() == logits.shape[0]:
                    sampled = ids  # one group holds every row, in order
                else:
                    if sampled is None:
                        sampled = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
                    sampled[dist.index] = ids
        if md.has_penalties:
            md.penalty_state.update(md.rows_t, sampled, md.count_ones)
        logprobs = gather_logprobs(raw_logprobs, sampled, md.logprobs_k) if raw_logprobs is not None else None
        return sampled, logprobs

    def processed_logprobs(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The distributions the rows draw from, as log-probabilities [B, vocab] (no draw, no state change).

        Random rows: after every stage up to top_k / top_p (-inf outside the kept set). Greedy
        rows: log_softmax of the processed logits (before temperature), whose argmax they take.
        """
        logits = apply_processors(logits, md)
        out = torch.log_softmax(logits.float(), dim=-1)
        for dist in random_dists(logits, md):
            probs = dist.probs / dist.probs.sum(dim=-1, keepdim=True)
            lp = probs.log()
            if dist.ids is None:
                out[dist.index] = lp
            else:
                rows = torch.full((dist.index.numel(), logits.shape[1]), _NEG_INF, device=logits.device)
                rows.scatter_(1, dist.ids, lp)
                out[dist.index] = rows
        return out

    def target_distributions(self, logits: torch.Tensor,
                             md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What each row would sample from, without sampling (speculative decoding verifies drafts
        against it): the argmax of the processed logits (a greedy row's choice) for every row, and
        for random rows their normalised distribution after every stage, [B, vocab] (zeros on
        greedy rows; None when every row is greedy). `logits` are left untouched."""
        x = apply_processors(logits, md)
        argmax = greedy_ids(x)
        if md.all_greedy:
            return argmax, None
        probs = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for dist in random_dists(x, md):
            p = dist.probs.float()
            p = p / p.sum(dim=-1, keepdim=True)
            if dist.ids is None:
                probs[dist.index] = p
            else:
                probs[dist.index] = torch.zeros((p.shape[0], x.shape[1]), device=x.device).scatter_(1, dist.ids, p)
        return argmax, probs


def gather_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, ks: np.ndarray) -> list[pb.TokenLogprobs | None]:
    """Per row: the logprob and rank of `token_ids[row]` under `raw` (log-softmaxed logits),
    plus the top `ks[row]` ids (None for rows with ks < 0). Shared by sampled-token and
    prompt logprobs."""
    max_k = int(ks.max())
    chosen_lp = raw.gather(1, token_ids[:, None])
    ranks = (raw > chosen_lp).sum(dim=-1) + 1
    top_lp, top_ids = raw.topk(max_k, dim=-1) if max_k > 0 else (raw[:, :0], token_ids[:, None][:, :0])
    chosen_lp, ranks = chosen_lp[:, 0].tolist(), ranks.tolist()
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    out: list[pb.TokenLogprobs | None] = []
    for i, k in enumerate(ks.tolist()):
        if k < 0:
            out.append(None)
            continue
        out.append(pb.TokenLogprobs(logprob=chosen_lp[i], rank=ranks[i],
                                    top_ids=top_ids[i][:k], top_logprobs=top_lp[i][:k]))
    return out
