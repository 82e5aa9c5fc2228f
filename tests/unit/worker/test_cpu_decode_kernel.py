"""The cpu backend's C decode kernel against exact (float64) attention, with error bounds
derived from the kernel's arithmetic, so the checks hold on any x86-64 machine (AVX2-only,
AVX-512, AMX) whatever order its vector units sum in.

All-decode ragged batches over a paged cache with shuffled (non-contiguous) blocks: both
unit shapes of the kernel (whole requests when there are many, single KV heads when there
are few), 1 and 2 threads, GQA ratios, head sizes with and without a specialised copy,
fp32 and bf16 caches (bf16 queries, and fp32 ones over a bf16 cache); scores hundreds apart;
the kernel's exp on its own. Each at every instruction-set level this CPU runs (the AVX-512
builds have their own 16-lane and bf16 dot-product code).

Why a bound and not a fixed tolerance: the kernel and torch both compute q.k in fp32, each
summing in its own order (8 lanes, 16 lanes, a GEMM's blocking), so with scores of ~100 their
results differ by ~1e-5 however exact each is. A fixed atol=1e-5 held on AVX-512
machines and failed on an AVX2-only one by 1.5e-5. Standard forward error analysis
(Higham, "Accuracy and Stability of Numerical Algorithms", ch. 3) bounds every fp32 step of
the kernel for any summation order, with or without FMA (u = 2^-24, g(n) = n*u / (1 - n*u)):

- score s_t = scale * sum_d q_d k_td: |error| <= (g(D) + u) * scale * sum_d |q_d k_td| =: e_t,
  and the argument s_t - max: another u * |s_t - max|. Let DELTA = max_t of their sum.
- exp: relative error <= ETA (checked directly below: the polynomial is within ~1.4 u).
- then each weight p_t = exp(s_t - m) / sum is off by a factor within
  [exp(-2 DELTA)(1-ETA)/(1+ETA), exp(2 DELTA)(1+ETA)/(1-ETA)] = 1 -+ KAPPA,
- the sums over L tokens (normaliser, weighted sum of V) and the final scaling add
  2 g(L + 1) + 3u relative to sum_t p_t |v_t|.
So |out - exact| <= (KAPPA + 2 g(L + 1) + 3u) * (1 + KAPPA) * sum_t p_t |v_t| per output
element. A bf16 output is the fp32 result rounded to bf16: plus 2^-8 (bf16's u) of its magnitude.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from support.isa_levels import levels_here

from services.worker.attention.base import AttentionMetadata
from services.worker.attention.cpu_backend import HIGHEST_ISA
from services.worker.attention.torch_backend import TorchAttentionBackend


def _num_blocks(seq_lens: list[int], block_size: int) -> int:
    """The cache's pool: the null block 0 and twice the blocks the batch uses, so they are drawn
    at random from among as many unused ones (a pool of a fixed 1,024 blocks made generating and
    checking the cache, not the kernel, most of these tests' time, under ASan most of all; and
    with fewer blocks past the used ones, a read past them is likelier to leave the tensor)."""
    return 1 + 2 * sum(-(-n // block_size) for n in seq_lens)


@pytest.fixture(scope="module", params=levels_here(HIGHEST_ISA), ids=lambda level: level or "default")
def cpu_backend(request):
    from services.worker.attention.cpu_backend import CpuAttentionBackend

    return CpuAttentionBackend(isa_level=request.param)


def _decode_batch(seq_lens: list[int], block_size: int, seed: int) -> AttentionMetadata:
    """Metadata of one decode step: each request's last position is its query token."""
    rng = np.random.default_rng(seed)
    lens = np.array(seq_lens, dtype=np.int64)
    blocks_per_req = -(-lens // block_size)
    ids = rng.permutation(np.arange(1, _num_blocks(seq_lens, block_size)))[:blocks_per_req.sum()]  # 0: the null block
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
    """Scores hundreds apart (std 8 and 40): most exp arguments fall below the clamp at -87."""
    _compare(cpu_backend, 3, torch.float32, 2, q_scale=q_scale)


@pytest.mark.parametrize("case", [0, 1, 3])
def test_cpu_decode_kernel_fp32_queries_over_a_bf16_cache(cpu_backend, case: int) -> None:
    """fp32 queries (an fp32 model) over a bf16 cache: the queries must not be rounded to bf16, so
    AVX512_BF16's bf16 dot products do not apply (the widening path at every level)."""
    _compare(cpu_backend, case, torch.bfloat16, 2, q_dtype=torch.float32)


EXP_RELATIVE_ERROR = 4 * 2.0 ** -24  # ETA: measured <= 1.4 u with and without FMA contraction


def _kernel_exp(cpu_backend, x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.empty_like(x)
    cpu_backend.lib.exp_neg_lanes(x.ctypes.data, y.ctypes.data, len(x))
    return y


@pytest.mark.parametrize("n", [8 * 100_003, 7])  # the 8-lane vector path; the scalar tail alone
def test_cpu_decode_kernel_exp_is_accurate_to_a_few_ulp(cpu_backend, n: int) -> None:
    """The softmax's exp over its whole domain [-87, 0], and the clamp below it: e^x for
    x < -87 is e^-87 (the smallest power the 2^n bit trick can build as a normal float), never
    garbage, a negative or an infinity."""
    x = -np.linspace(0.0, 87.0, n, dtype=np.float64).astype(np.float32)
    y = _kernel_exp(cpu_backend, x).astype(np.float64)
    exact = np.exp(x.astype(np.float64))
    assert np.all(np.abs(y - exact) <= EXP_RELATIVE_ERROR * exact)

    below = -np.linspace(87.0, 1e4, n, dtype=np.float64)[1:].astype(np.float32)
    y_below = _kernel_exp(cpu_backend, below).astype(np.float64)
    assert np.all(np.abs(y_below - np.exp(-87.0)) <= EXP_RELATIVE_ERROR * np.exp(-87.0))


def _exact_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float) -> tuple[np.ndarray, np.ndarray]:
    """float64 attention of each request's query over its cached tokens, and the per-element
    error bound of the kernel's fp32 arithmetic (module docstring)."""
    u = 2.0 ** -24

    def g(n: int) -> float:
        return n * u / (1 - n * u)

    q64 = q.double().numpy()
    k64, v64 = k_cache.double().numpy(), v_cache.double().numpy()
    table = meta.block_table.numpy()
    batch, num_heads, head_dim = q64.shape
    group = num_heads // k64.shape[2]
    block_size = k64.shape[1]
    exact, bound = np.zeros_like(q64), np.zeros_like(q64)
    for b, seq_len in enumerate(meta.seq_lens.tolist()):
        pos = np.arange(seq_len)
        blocks, offsets = table[b, pos // block_size], pos % block_size
        keys = np.repeat(k64[blocks, offsets], group, axis=1)  # [L, H, D]
        values = np.repeat(v64[blocks, offsets], group, axis=1)
        scores = np.einsum("hd,lhd->hl", q64[b], keys) * scale
        abs_dot = np.einsum("hd,lhd->hl", np.abs(q64[b]), np.abs(keys)) * scale
        gap = scores.max(axis=1, keepdims=True) - scores
        delta = ((g(head_dim) + u) * abs_dot + u * gap).max(axis=1)  # [H]
        p = np.exp(-gap)
        p /= p.sum(axis=1, keepdims=True)
        exact[b] = np.einsum("hl,lhd->hd", p, values)
        eta = EXP_RELATIVE_ERROR
        kappa = np.exp(2 * delta) * (1 + eta) / (1 - eta) - 1
        magnitude = np.einsum("hl,lhd->hd", p, np.abs(values))
        bound[b] = ((kappa + 2 * g(seq_len + 1) + 3 * u) * (1 + kappa))[:, None] * magnitude
    return exact, bound


def _compare(cpu_backend, case: int, dtype: torch.dtype, threads: int, q_scale: float = 1.0,
             q_dtype: torch.dtype | None = None) -> None:
    """dtype: the cache's, and the queries' (and outputs') unless q_dtype says otherwise."""
    seq_lens, num_heads, num_kv_heads, head_dim, block_size = CASES[case]
    meta = _decode_batch(seq_lens, block_size, seed=case)
    gen = torch.Generator().manual_seed(case)
    kv_cache = torch.randn(2, _num_blocks(seq_lens, block_size), block_size, num_kv_heads, head_dim,
                           generator=gen).to(dtype)
    batch = len(seq_lens)
    q_dtype = q_dtype or dtype
    q = (q_scale * torch.randn(batch, num_heads, head_dim, generator=gen)).to(q_dtype)
    k = torch.randn(batch, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, num_kv_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5

    # The torch reference stores this step's K/V; the kernel must store the same at the same slots.
    reference = TorchAttentionBackend()
    ref_cache = kv_cache.clone()
    meta.backend_data = reference.prepare(meta)
    reference.forward(q.to(dtype), k, v, ref_cache, meta, scale)  # (torch's SDPA wants one dtype)

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        meta.backend_data = cpu_backend.prepare(meta)
        got = cpu_backend.forward(q, k, v, kv_cache, meta, scale)
    finally:
        torch.set_num_threads(previous)

    assert torch.equal(kv_cache, ref_cache)
    assert got.dtype == q_dtype and got.shape == q.shape
    exact, bound = _exact_attention(q, kv_cache[0], kv_cache[1], meta, scale)
    if q_dtype == torch.bfloat16:  # fp32 math over the bf16 cache, the result rounded to bf16
        bound = bound + 2.0 ** -8 * (np.abs(exact) + bound)  # bf16 keeps 8 significant bits: u = 2^-8
    error = np.abs(got.double().numpy() - exact)
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert np.all(error <= bound), (
        f"error {error[worst]:.3g} over its bound {bound[worst]:.3g} at {worst} (request, head, dim)")


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


# /proc/cpuinfo flags of the three machine kinds CI runs on (the parts that matter here).
_AVX2_EPYC = {"sse4_1", "sse4_2", "ssse3", "cx16", "lahf_lm", "popcnt", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma",
              "abm", "movbe", "xsave"}
_AVX512_EPYC = _AVX2_EPYC | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16"}
_AMX_XEON = _AVX512_EPYC | {"amx_tile", "amx_bf16"}


def test_cpu_decode_kernel_builds_one_fixed_level_per_machine_kind(monkeypatch) -> None:
    """Each machine kind builds a fixed x86-64 level (so every machine of a kind runs one binary,
    one set of results), never -march=native: v3 for kernels that stop at AVX2 (the default), and
    for the attention kernels (up to avx512_bf16) v4 + AVX512_BF16 where the CPU has them, plain
    v4 without bf16, v3 on an AVX2 machine; MYVLLM_CPU_ISA caps the level; lower levels where AVX2
    or FMA is missing, the compiler's default off x86."""
    from services.worker.cpu.cbuild import ISA_ENV, isa_flags

    monkeypatch.delenv(ISA_ENV, raising=False)
    kinds = (_AVX2_EPYC, _AVX512_EPYC, _AMX_XEON)
    assert {tuple(isa_flags("x86_64", kind)) for kind in kinds} == {("-march=x86-64-v3",)}
    assert [isa_flags("x86_64", kind, highest="avx512_bf16") for kind in kinds] == [
        ["-march=x86-64-v3"], ["-march=x86-64-v4", "-mavx512bf16"], ["-march=x86-64-v4", "-mavx512bf16"]]
    assert isa_flags("x86_64", _AVX512_EPYC - {"avx512_bf16"}, highest="avx512_bf16") == ["-march=x86-64-v4"]
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert isa_flags("x86_64", _AMX_XEON, highest="avx512_bf16") == ["-march=x86-64-v3"]
    monkeypatch.delenv(ISA_ENV)
    assert isa_flags("x86_64", _AVX2_EPYC - {"fma"}) == ["-march=x86-64-v2"]
    assert isa_flags("x86_64", set()) == ["-march=x86-64"]
    assert isa_flags("aarch64", _AVX2_EPYC) == []


def test_cpu_decode_kernel_build_key_follows_the_compiler_version(tmp_path, monkeypatch) -> None:
    """A compiler upgrade (same path, new version) must not load a library the old one built."""
    from services.worker.attention.cpu_backend import _SOURCE
    from services.worker.cpu import cbuild

    versions = iter(["gcc (Debian 12.2.0-14) 12.2.0", "gcc (Debian 13.1.0-1) 13.1.0"])
    monkeypatch.setattr(cbuild, "compiler_version", lambda cc: next(versions))
    flags = ["-O3", "-march=x86-64-v3"]
    assert cbuild.build_key(_SOURCE, "/usr/bin/gcc", flags) != cbuild.build_key(_SOURCE, "/usr/bin/gcc", flags)
