"""One step's verification of drafts on the worker: the target logits of every scored position
→ each request's emitted tokens (accepted drafts + one), and their logprobs when asked.

The rows being verified take no history-dependent processing (services/common/spec_config.py
`may_speculate`), so the distribution at each position is the request's ordinary sampling
distribution: the same `SamplingMetadata` stages, built for the rows repeated per position.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from services.common.proto import myvllm_pb2 as pb
from services.worker.sampler import Sampler, gather_logprobs
from services.worker.sampling_metadata import SamplingMetadata
from services.worker.spec_decode.rejection_sampler import rejection_sample


def verify_drafts(
    sampler: Sampler,
    logits: torch.Tensor,
    md: SamplingMetadata,
    num_draft: np.ndarray,
    draft_ids: np.ndarray,
    draft_probs: torch.Tensor | None = None,
    sync: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[list[list[int]], list[list[pb.TokenLogprobs]] | None]:
    """`logits` [sum(num_draft + 1), V]: request r's positions in order; `md` built for the
    rows repeated per position; `draft_ids` [R, K] padded. Returns the tokens each request
    emits and, if any asked, their logprobs (from the raw logits, as without drafts). `sync`
    (tensor parallelism: rank 0's tensor on every rank) makes every rank emit rank 0's tokens,
    whatever its own random draws were."""
    dev = logits.device
    raw = torch.log_softmax(logits.float(), dim=-1) if md.logprobs_k is not None else None
    target_argmax, target_probs = sampler.target_distributions(logits, md)
    starts = np.concatenate([[0], np.cumsum(num_draft + 1)[:-1]])
    greedy = md.greedy_mask[torch.from_numpy(starts).to(dev)]
    tokens, num_tokens = rejection_sample(target_argmax, target_probs, num_draft,
                                          torch.from_numpy(draft_ids.astype(np.int64)).to(dev), greedy, draft_probs)
    if sync is not None:
        tokens, num_tokens = sync(tokens.contiguous()), sync(num_tokens.contiguous())
    tokens_np, counts = tokens.cpu().numpy(), num_tokens.cpu().numpy()
    emitted = [tokens_np[r, :counts[r]].tolist() for r in range(len(counts))]
    if raw is None:
        return emitted, None
    flat = np.concatenate([starts[r] + np.arange(counts[r]) for r in range(len(counts))])
    chosen = torch.from_numpy(np.concatenate([tokens_np[r, :counts[r]] for r in range(len(counts))])).to(dev)
    lps = gather_logprobs(raw[torch.from_numpy(flat).to(dev)], chosen.long(), md.logprobs_k[flat])
    out, i = [], 0
    for n in counts.tolist():
        out.append([lp if lp is not None else pb.TokenLogprobs() for lp in lps[i:i + n]])
        i += n
    return emitted, out
