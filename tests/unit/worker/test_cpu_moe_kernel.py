"""The routed experts' C kernel (services/worker/cpu/moe_experts.c) against the torch path
(models/moe.py's `grouped_experts`), fp32 and bf16, at each instruction-set level with code of its
own that this CPU runs, on 1 and 2 threads: one token and many (an expert's group past one
96-row chunk), top-k 1, 2 and 8, experts with no token, ids of another rank's experts (outside
[0, E)), widths and hidden sizes that are not whole 32-column blocks (the packing pads them).

Two checks:
- where every GEMM sum is exact (small integers; SiLU(g) = g for the large gates used; a down
  projection that picks one value times a power of two), the kernel equals the torch path to the
  bit: the grouping, SiLU·up, the weights' epilogue and the per-token sums in ascending expert
  order round exactly alike;
- on random values, whose GEMM sums the kernel adds in another order than torch's, each output is
  within a bound of the torch path's, relative to the largest magnitude of its layer's output:
  2^-18 in fp32 (2^-23 is fp32's unit roundoff: a few dozen roundings' worth) and 2^-6 in bf16
  (a couple of bf16 steps, 2^-8: a GEMM output rounded the other way changes what later roundings
  see).
"""

from __future__ import annotations

import pytest
import torch
from support.isa_levels import levels_here

from services.worker.cpu.moe_experts import HIGHEST_ISA, CpuMoeExperts
from services.worker.models.moe import FusedExperts, grouped_experts, moe_experts

LEVELS = [level for level in levels_here(HIGHEST_ISA) if CpuMoeExperts.load(level) is not None]
pytestmark = pytest.mark.skipif(not LEVELS, reason="this CPU has no AVX2 (the experts keep the torch path)")
LEVEL_DTYPES = [(level, dtype) for level in LEVELS for dtype in CpuMoeExperts.load(level).dtypes]
BOUND = {torch.float32: 2.0 ** -18, torch.bfloat16: 2.0 ** -6}

# (tokens, top-k, experts, hidden, expert width)
SHAPES = [
    (1, 1, 4, 64, 32),
    (1, 8, 64, 128, 96),
    (5, 2, 8, 40, 48),
    (37, 3, 6, 24, 10),
    (300, 8, 16, 96, 64),
]


def _ids(gen: torch.Generator, tokens: int, top_k: int, experts: int) -> torch.Tensor:
    """Distinct ids per token, some of them another rank's (-1 or `experts`), expert 1 never."""
    pool = torch.tensor([e for e in range(-1, experts + 1) if e != 1])
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:top_k]] for _ in range(tokens)])
    return ids


def _run(kernel: CpuMoeExperts, threads: int, x, w13, w2, weights, ids) -> torch.Tensor:
    w13p, w2p = kernel.pack(w13, w2)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return kernel.experts(x, w13p, w2p, weights, ids)
    finally:
        torch.set_num_threads(previous)


def _routing_weights(gen: torch.Generator, tokens: int, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.rand(tokens, top_k, generator=gen).to(dtype)


@pytest.mark.parametrize(("level", "dtype"), LEVEL_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "t{}-k{}-e{}-h{}-i{}".format(*s))
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_equals_the_torch_path_where_the_sums_are_exact(level, dtype, shape, threads) -> None:
    tokens, top_k, experts, hidden, width = shape
    gen = torch.Generator().manual_seed(tokens * 31 + top_k)
    x = torch.randint(1, 4, (tokens, hidden), generator=gen).to(dtype)
    gate = 20.0 * torch.randint(0, 2, (experts, width, hidden), generator=gen)  # gates 0 or >= 20
    up = torch.randint(-2, 3, (experts, width, hidden), generator=gen).float()
    w13 = torch.cat((gate, up), dim=1).to(dtype)
    # each output column takes one intermediate value times a power of two
    picks = torch.randint(0, width, (experts, hidden), generator=gen)
    scales = 2.0 ** torch.randint(-3, 2, (experts, hidden), generator=gen).float()
    w2 = torch.zeros(experts, hidden, width).scatter_(2, picks[..., None], scales[..., None]).to(dtype)
    ids = _ids(gen, tokens, top_k, experts)
    for weights_dtype in {torch.float32, dtype}:
        weights = _routing_weights(gen, tokens, top_k, weights_dtype)
        got = _run(CpuMoeExperts.load(level), threads, x, w13, w2, weights, ids)
        want = grouped_experts(x, w13, w2, weights, ids)
        assert got.dtype == dtype and torch.equal(got, want), float((got.float() - want.float()).abs().max())


@pytest.mark.parametrize(("level", "dtype"), LEVEL_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "t{}-k{}-e{}-h{}-i{}".format(*s))
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_is_within_rounding_of_the_torch_path(level, dtype, shape, threads) -> None:
    tokens, top_k, experts, hidden, width = shape
    gen = torch.Generator().manual_seed(tokens * 17 + top_k)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * width, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, width, generator=gen) / width ** 0.5).to(dtype)
    ids = _ids(gen, tokens, top_k, experts)
    weights = _routing_weights(gen, tokens, top_k, dtype)
    got = _run(CpuMoeExperts.load(level), threads, x, w13, w2, weights, ids)
    want = grouped_experts(x, w13, w2, weights, ids)
    scale = float(want.float().abs().max())  # 0 where the only id is another rank's
    err = float((got.float() - want.float()).abs().max())
    assert err <= BOUND[dtype] * scale, (err, scale)


def test_no_tokens_and_only_other_ranks_experts_give_zeros() -> None:
    kernel = CpuMoeExperts.load(LEVELS[0])
    w13p, w2p = kernel.pack(torch.randn(3, 2 * 40, 64), torch.randn(3, 64, 40))
    empty = kernel.experts(torch.empty(0, 64), w13p, w2p, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int64))
    assert empty.shape == (0, 64)
    elsewhere = torch.tensor([[-1, 3], [5, -2]])
    out = kernel.experts(torch.randn(2, 64), w13p, w2p, torch.rand(2, 2), elsewhere)
    assert torch.equal(out, torch.zeros(2, 64))


def test_packed_experts_run_the_kernel_through_the_op() -> None:
    """`FusedExperts.pack_for_cpu` swaps in the packed weights (once), and the layer's forward,
    eager or compiled (the op is opaque), gives the torch path's result within the fp32 bound."""
    gen = torch.Generator().manual_seed(3)
    experts = FusedExperts(4, 64, 48)
    with torch.no_grad():
        experts.w13.copy_(torch.randn(4, 96, 64, generator=gen) / 8)
        experts.w2.copy_(torch.randn(4, 64, 48, generator=gen) / 7)
    w13, w2 = experts.w13.detach().clone(), experts.w2.detach().clone()
    x, ids = torch.randn(9, 64, generator=gen), torch.randint(0, 4, (9, 2), generator=gen)
    weights = torch.rand(9, 2, generator=gen)
    assert experts.pack_for_cpu() and experts.packed and not experts.pack_for_cpu()
    assert experts.w13.shape == (4, 2, 2, 64, 32) and experts.w2.shape == (4, 2, 64, 32)
    want = grouped_experts(x, w13, w2, weights, ids)
    for got in (experts(x, weights, ids), torch.compile(experts, backend="eager")(x, weights, ids),
                moe_experts(x, experts.w13, experts.w2, weights, ids, True)):
        assert float((got - want).abs().max()) <= BOUND[torch.float32] * float(want.abs().max())
