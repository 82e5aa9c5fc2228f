"""Expert parallelism across ranks whose tokens differ (data-parallel attention): each rank holds
a contiguous share of the experts; every (token, slot) pair is sent to the rank that holds its
expert, computed there, and sent back (two all-to-alls, torch.distributed's
`all_to_all_single`: gloo on CPU, NCCL on CUDA).

One call per MoE layer on every rank of the group, in the same order: a rank without tokens
still takes part with empty tensors (its dummy step), or the others would wait for it.
Each token's expert outputs are summed in ascending expert order, as HF's reference does, so
fp32 results match one rank holding every expert.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

# This rank's experts on the pairs sent to it: (rows [N, H], weights [N, 1], local ids [N, 1]) →
# the weighted outputs [N, H] (services/worker/models/moe.py's op over the local w13 / w2).
LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def expert_owners(ids: torch.Tensor, expert_starts: torch.Tensor) -> torch.Tensor:
    """The rank that holds each expert id: expert_starts [world] are the ranks' first experts."""
    return torch.bucketize(ids, expert_starts, right=True) - 1


def dispatch_and_combine(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: LocalExperts,
                         expert_starts: torch.Tensor, num_experts: int,
                         group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's MoE output [T, H] for its tokens x [T, H] routed to global expert `ids` [T, k]
    (of `num_experts`) with `weights` [T, k]; `experts` runs this rank's experts, the ones from
    expert_starts[rank] on."""
    world = dist.get_world_size(group)
    num_tokens, top_k = ids.shape
    flat_ids = ids.reshape(-1)
    owners = expert_owners(flat_ids, expert_starts)
    order = torch.argsort(owners, stable=True)  # the pairs grouped by the rank that computes them
    send_counts = torch.bincount(owners, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    # What goes out per pair: the token's hidden row, and (expert id on its owner, weight).
    rows = x.index_select(0, order // top_k)
    meta = torch.stack(((flat_ids[order] - expert_starts[owners[order]]).to(torch.float32),
                        weights.reshape(-1)[order].to(torch.float32)), dim=1)
    got_rows = x.new_empty((sum(recv), x.shape[1]))
    got_meta = meta.new_empty((sum(recv), 2))
    dist.all_to_all_single(got_rows, rows, recv, send, group=group)
    dist.all_to_all_single(got_meta, meta, recv, send, group=group)
    # Each received pair is a token of its own with one expert (ids < 2^24: exact in fp32).
    local_ids = got_meta[:, :1].to(torch.int64)
    pair_weights = got_meta[:, 1:].to(weights.dtype)
    computed = experts(got_rows, pair_weights, local_ids) if len(got_rows) else got_rows
    returned = x.new_empty((sum(send), x.shape[1]))
    dist.all_to_all_single(returned, computed, send, recv, group=group)
    # returned[i] belongs to pair order[i]; add each token's pairs in ascending expert order.
    by_pair = torch.empty_like(returned)
    by_pair[order] = returned
    sequence = torch.argsort(torch.arange(num_tokens * top_k, device=x.device) // top_k * num_experts + flat_ids)
    return torch.zeros_like(x).index_add_(0, sequence // top_k, by_pair[sequence])
