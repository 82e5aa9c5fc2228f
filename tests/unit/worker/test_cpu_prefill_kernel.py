"""The cpu backend's C prefill kernel (attention/cpu_paged_prefill.c) against exact (float64)
causal attention, at each instruction-set level this CPU runs: steps mixing decodes with prefill
chunks with and without cached context, ragged lengths around the kernel's 16-token tiles,
shuffled paged blocks, GQA ratios, head sizes with and without a specialised copy, fp32 and bf16,
strided query rows (a view of the fused qkv output, as the model hands them over), 1 and 2 threads.

The tolerance is an error bound, not a machine's observed error: scores here are O(1) (unit
normal q and k, scale 1/sqrt(D)), so each fp32 dot product (bf16 dot products too: their products
are exact, their sums fp32), the softmax's exp (~2e-7 relative) and the sums over at most a few
hundred keys stay well within 1e-5 of the output's scale, whatever order a machine's vector units
sum in. bf16 outputs add their rounding to bf16: up to half a bf16 step of the fp32 result,
bounded here by a whole step (2^-7 of the value).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.isa_levels import levels_here

from services.worker.attention.base import AttentionMetadata
from services.worker.attention.cpu_backend import HIGHEST_ISA

NUM_BLOCKS = 256


@pytest.fixture(scope="module", params=levels_here(HIGHEST_ISA), ids=lambda level: level or "default")
def cpu_backend(request):
    from services.worker.attention.cpu_backend import CpuAttentionBackend

    return CpuAttentionBackend(isa_level=request.param)


CASES = [
    # (context lens, new tokens per request, heads, kv heads, head size, block size)
    ([0, 0, 12, 0, 40], [5, 16, 17, 1, 33], 9, 3, 64, 16),   # SmolLM2's shape, two decodes among prefills
    ([0, 100, 3], [100, 60, 1], 4, 4, 128, 16),              # MHA, head size 128, a chunk after 100 cached
    ([7, 0], [31, 48], 8, 2, 32, 8),                         # head size without a specialised copy
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_kernel_matches_exact_causal_attention(cpu_backend, case: int, dtype: torch.dtype,
                                                       threads: int) -> None:
    ctx_lens, new_lens, heads, kv_heads, d, bs = CASES[case]
    gen = torch.Generator().manual_seed(case)
    rng = np.random.default_rng(case)
    ctx, new = np.array(ctx_lens), np.array(new_lens)
    seq = ctx + new
    blocks = -(-seq // bs)
    ids = rng.permutation(np.arange(1, NUM_BLOCKS))[:blocks.sum()]
    table = np.zeros((len(seq), blocks.max()), dtype=np.int32)
    start = 0
    for i, n in enumerate(blocks):
        table[i, :n] = ids[start:start + n]
        start += n
    cache = torch.zeros(2, NUM_BLOCKS, bs, kv_heads, d, dtype=dtype)
    # Whole sequences' K/V; the context part goes into the cache now, the new part through forward.
    keys = [torch.randn(int(n), kv_heads, d, generator=gen).to(dtype) for n in seq]
    values = [torch.randn(int(n), kv_heads, d, generator=gen).to(dtype) for n in seq]
    for i in range(len(seq)):
        for pos in range(int(ctx[i])):
            cache[0, table[i, pos // bs], pos % bs] = keys[i][pos]
            cache[1, table[i, pos // bs], pos % bs] = values[i][pos]
    rows = np.repeat(np.arange(len(seq)), new)
    pos = np.concatenate([np.arange(c, s) for c, s in zip(ctx, seq, strict=True)])
    slots = table[rows, pos // bs].astype(np.int64) * bs + pos % bs
    qsl = np.concatenate([[0], np.cumsum(new)])
    meta = AttentionMetadata.from_host(slots, qsl, seq, ctx, table, bs, "cpu")
    meta.backend_data = cpu_backend.prepare(meta)
    assert len(meta.backend_data.prefills) == int((new > 1).sum())
    # q as strided rows of a wider tensor, like the fused qkv projection's output
    t = int(new.sum())
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    q = qkv[:, :heads * d].view(t, heads, d)
    k = torch.cat([keys[i][int(ctx[i]):] for i in range(len(seq))])
    v = torch.cat([values[i][int(ctx[i]):] for i in range(len(seq))])
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_backend.forward(q, k, v, cache, meta, d ** -0.5)
    finally:
        torch.set_num_threads(previous)
    group = heads // kv_heads
    for i in range(len(seq)):
        qi = q[qsl[i]:qsl[i + 1]].double().transpose(0, 1)                            # [H, n, D]
        ki = keys[i].double().repeat_interleave(group, dim=1).transpose(0, 1)         # [H, L, D]
        vi = values[i].double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = qi @ ki.transpose(1, 2) * d ** -0.5
        qpos = torch.arange(int(ctx[i]), int(seq[i]))
        scores = scores.masked_fill(torch.arange(int(seq[i]))[None, :] > qpos[:, None], float("-inf"))
        exact = (torch.softmax(scores, dim=-1) @ vi).transpose(0, 1)                  # [n, H, D]
        got = out[qsl[i]:qsl[i + 1]].double()
        bound = 1e-5 * vi.abs().max() + (2.0 ** -7 * exact.abs() if dtype == torch.bfloat16 else 0)
        assert bool(((got - exact).abs() <= bound).all()), (i, float((got - exact).abs().max()))
    # the new tokens' K/V were stored where the step's slots say
    flat_k = cache[0].view(-1, kv_heads, d)
    assert torch.equal(flat_k[torch.from_numpy(slots)], k)


def test_prefill_kernel_is_used_for_prefills(cpu_backend, monkeypatch) -> None:
    """The backend hands every prefill chunk of a step to the C kernel in one call."""
    calls: list[int] = []
    original = cpu_backend.prefill_lib.paged_prefill

    class Spy:
        def __call__(self, *args):
            calls.append(args[11])  # the number of chunks
            return original(*args)

    monkeypatch.setattr(cpu_backend.prefill_lib, "paged_prefill", Spy())
    bs, kv_heads, d = 16, 3, 64
    cache = torch.zeros(2, 32, bs, kv_heads, d)
    new = np.array([20, 9])
    table = np.array([[1, 2], [3, 0]], dtype=np.int32)
    pos = np.concatenate([np.arange(n) for n in new])
    rows = np.repeat(np.arange(2), new)
    slots = table[rows, pos // bs].astype(np.int64) * bs + pos % bs
    meta = AttentionMetadata.from_host(slots, np.array([0, 20, 29]), new, np.zeros(2, np.int64), table, bs, "cpu")
    meta.backend_data = cpu_backend.prepare(meta)
    q, k, v = torch.randn(29, 9, d), torch.randn(29, kv_heads, d), torch.randn(29, kv_heads, d)
    cpu_backend.forward(q, k, v, cache, meta, 0.125)
    assert calls == [2]
