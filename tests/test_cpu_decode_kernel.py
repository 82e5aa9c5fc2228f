"""The cpu backend's C decode kernel against the torch reference backend.

All-decode ragged batches over a paged cache with shuffled (non-contiguous) blocks: both
unit shapes of the kernel (whole requests when there are many, single KV heads when there
are few), 1 and 2 threads, GQA ratios, head sizes with and without a specialised copy,
fp32 and bf16 caches.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from services.worker.attention.base import AttentionMetadata
from services.worker.attention.torch_backend import TorchAttentionBackend

NUM_BLOCKS = 1024


@pytest.fixture(scope="module")
def cpu_backend():
    from services.worker.attention.cpu_backend import CpuAttentionBackend

    return CpuAttentionBackend()


def _decode_batch(seq_lens: list[int], block_size: int, seed: int) -> AttentionMetadata:
    """Metadata of one decode step: each request's last position is its query token."""
    rng = np.random.default_rng(seed)
    lens = np.array(seq_lens, dtype=np.int64)
    blocks_per_req = -(-lens // block_size)
    ids = rng.permutation(np.arange(1, NUM_BLOCKS))[:blocks_per_req.sum()]  # block 0 is the null block
    table = np.zeros((len(lens), blocks_per_req.max()), dtype=np.int32)
    start = 0
    for i, n in enumerate(blocks_per_req):
        table[i, :n] = ids[start:start + n]
        start += n
    pos = lens - 1
    slots = table[np.arange(len(lens)), pos // block_size].astype(np.int64) * block_size + pos % block_size
    qsl = np.arange(len(lens) + 1, dtype=np.int64)
    return AttentionMetadata.from_host(slots, qsl, lens, lens - 1, table, block_size, "cpu")


CASES = [
    # (seq_lens, num_heads, num_kv_heads, head_dim, block_size)
    ([37], 9, 3, 64, 16),                           # batch 1: split by KV head
    ([1, 200, 17], 8, 8, 128, 16),                  # no GQA, a 1-token sequence
    ([5, 64, 300, 90, 33, 1, 77, 129, 16, 250], 16, 4, 80, 16),  # whole requests, generic head size
    (list(range(3, 400, 13)), 9, 3, 64, 16),        # 31 requests: whole-request units
    ([700, 3, 45, 12, 9, 31, 2, 100, 8], 12, 3, 64, 5),  # odd block size, long sequence
    ([10, 20, 30, 40], 4, 1, 8, 16),                # 4 query heads per KV head, tiny head
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_cpu_decode_kernel_matches_torch_reference(cpu_backend, case: int, dtype: torch.dtype, threads: int) -> None:
    _compare(cpu_backend, case, dtype, threads)


@pytest.mark.parametrize("q_scale", [8.0, 40.0])
def test_cpu_decode_kernel_softmax_over_a_wide_score_range(cpu_backend, q_scale: float) -> None:
    """Scores hundreds apart: the kernel's own exp (vector and scalar lanes, and its clamp at
    e^-87) must still give torch's softmax."""
    _compare(cpu_backend, 3, torch.float32, 2, q_scale=q_scale)


def _compare(cpu_backend, case: int, dtype: torch.dtype, threads: int, q_scale: float = 1.0) -> None:
    seq_lens, num_heads, num_kv_heads, head_dim, block_size = CASES[case]
    meta = _decode_batch(seq_lens, block_size, seed=case)
    gen = torch.Generator().manual_seed(case)
    kv_cache = torch.randn(2, NUM_BLOCKS, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    batch = len(seq_lens)
    q = (q_scale * torch.randn(batch, num_heads, head_dim, generator=gen)).to(dtype)
    k = torch.randn(batch, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, num_kv_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5

    reference = TorchAttentionBackend()
    ref_cache = kv_cache.clone()
    meta.backend_data = reference.prepare(meta)
    expected = reference.forward(q, k, v, ref_cache, meta, scale)

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        meta.backend_data = cpu_backend.prepare(meta)
        got = cpu_backend.forward(q, k, v, kv_cache, meta, scale)
    finally:
        torch.set_num_threads(previous)

    assert torch.equal(kv_cache, ref_cache)  # the same K/V stored at the same slots
    assert got.dtype == dtype and got.shape == expected.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    else:  # the reference computes in bf16, the kernel in fp32 over the same bf16 cache
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_cpu_decode_kernel_shares_torch_openmp_runtime(cpu_backend) -> None:
    """The kernel must bind to the libgomp torch loaded: a second OpenMP runtime would bring
    its own threads that fight torch's spinning workers for the cores. The kernel's NEEDED entry
    is the soname libgomp.so.1, so a second copy would be another file of that name (e.g. the
    system's); runtimes other wheels vendor under hashed names (sentencepiece's) are not ours."""
    mapped = set()
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libgomp.so"):
                mapped.add(path)
    assert len(mapped) <= 1, f"more than one libgomp.so.1 loaded: {sorted(mapped)}"
