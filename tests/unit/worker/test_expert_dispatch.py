"""Expert parallelism across ranks with different tokens: two gloo ranks, each holding half of
the experts and its own tokens (one of them none: a dummy step), give each token exactly what
one rank holding every expert gives (fp32, the same order of adds; a GEMM over another number
of rows may round its last bit differently)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.processes import free_port

from services.worker.models.expert_dispatch import dispatch_and_combine, expert_owners
from services.worker.models.moe import grouped_experts

NUM_EXPERTS, HIDDEN, WIDTH, TOP_K = 6, 16, 8, 3


def _problem(num_tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOP_K] for _ in range(num_tokens)]) \
        if num_tokens else torch.empty(0, TOP_K, dtype=torch.int64)
    weights = torch.rand(num_tokens, TOP_K, generator=g)
    return x, weights, ids


def _weights():
    g = torch.Generator().manual_seed(99)
    return (torch.randn(NUM_EXPERTS, 2 * WIDTH, HIDDEN, generator=g) / 4,
            torch.randn(NUM_EXPERTS, HIDDEN, WIDTH, generator=g) / 4)


TOKENS = {0: 11, 1: 0}  # rank 1 has nothing to do this step


def _rank(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        w13, w2 = _weights()
        starts = torch.tensor([0, 3])
        mine = slice(int(starts[rank]), int(starts[rank]) + 3)
        for step, tokens in enumerate((TOKENS, {0: 5, 1: 9})):
            x, weights, ids = _problem(tokens[rank], seed=10 * step + rank)
            experts = lambda rows, w, i: grouped_experts(rows, w13[mine], w2[mine], w, i)  # noqa: E731
            out = dispatch_and_combine(x, weights, ids, experts, starts, NUM_EXPERTS)
            torch.save(out, f"{out_dir}/{rank}-{step}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_with_half_the_experts_each_equal_one_rank_with_all(tmp_path) -> None:
    assert expert_owners(torch.tensor([0, 2, 3, 5]), torch.tensor([0, 3])).tolist() == [0, 0, 1, 1]
    mp.start_processes(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    w13, w2 = _weights()
    for step, tokens in enumerate((TOKENS, {0: 5, 1: 9})):
        for rank in (0, 1):
            x, weights, ids = _problem(tokens[rank], seed=10 * step + rank)
            out = torch.load(tmp_path / f"{rank}-{step}.pt")
            assert out.shape == (tokens[rank], HIDDEN)
            torch.testing.assert_close(out, grouped_experts(x, w13, w2, weights, ids), rtol=1e-6, atol=1e-6)
