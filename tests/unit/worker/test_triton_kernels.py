"""The Triton attention backend against the torch reference, on random ragged batches.

Without CUDA the kernels run under TRITON_INTERPRET=1 on CPU tensors (tiny sizes: the
interpreter is slow). With CUDA (and TRITON_INTERPRET unset) the same cases run compiled on
the GPU, plus a few larger ones; `scripts/gpu_check.sh` runs this file there. Each case
checks both the cache after the store (exactly) and the attention output (fp32 1e-4,
bf16 2e-2, fp16 5e-3).

The module imports without pytest too (`run_cases` is what gpu_check.py calls when pytest
is missing).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# Before triton is first imported: on a machine without CUDA, interpret. (Triton decides at
# import time; `import torch` does not import it.)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import pytest
except ModuleNotFoundError:  # gpu_check.py's fallback runner
    pytest = None

from services.worker.attention import triton_kernels  # noqa: E402
from services.worker.attention.base import AttentionMetadata
from services.worker.attention.selector import get_attention_backend  # noqa: E402
from services.worker.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from services.worker.attention.triton_backend import TritonAttentionBackend  # noqa: E402


def _interpret_wanted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


INTERPRETED = triton_kernels.is_interpreted()
# Another test module imported triton before TRITON_INTERPRET was set: triton's own helpers
# (tl.zeros, tl.max, ...) were then built for a GPU and cannot be interpreted in this process,
# so the cases run in a fresh one (test_in_fresh_interpreter_process).
STALE_TRITON = _interpret_wanted() and not (INTERPRETED and triton_kernels.interpreter_consistent())
DEVICE = None if STALE_TRITON else "cpu" if INTERPRETED else "cuda" if torch.cuda.is_available() else None
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@dataclass(frozen=True)
class Case:
    name: str
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    reqs: tuple[tuple[int, int], ...]  # (context_len, query_len) per request
    block_size: int = 16
    block_m: int | None = None
    tile_n: int = 32
    pad: int = 0              # padding tokens after the last request (slot -1)
    cuda_only: bool = False

    def __str__(self) -> str:
        return self.name


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CASES = [
    Case("mixed_gqa1_d64_f32", F32, 2, 2, 64, ((0, 9), (21, 1), (16, 20), (37, 1))),
    Case("chunked_gqa3_d128_f32", F32, 6, 2, 128, ((32, 17), (5, 3), (0, 16))),
    Case("decode_gqa4_d64_f32", F32, 8, 2, 64, ((44, 1), (0, 1), (15, 1), (16, 1), (70, 1))),
    Case("mixed_gqa4_d128_bf16", BF16, 4, 1, 128, ((12, 13), (50, 1), (0, 5), (33, 1))),
    Case("chunked_gqa3_d64_bf16", BF16, 3, 1, 64, ((0, 24), (19, 7))),
    Case("decode_gqa1_d128_bf16", BF16, 2, 2, 128, ((30, 1), (3, 1), (64, 1))),
    Case("mixed_gqa2_d64_f16", F16, 4, 2, 64, ((9, 6), (27, 1))),
    # Several query blocks per request (BLOCK_Q 8), key tiles spanning four 8-slot blocks.
    Case("multiblock_bs8_f32", F32, 4, 2, 64, ((10, 40), (3, 1)), block_size=8, block_m=16),
    # Key tiles smaller than a cache block; padding tokens that must not be stored.
    Case("bs32_tile16_pad_f32", F32, 4, 4, 64, ((40, 2), (0, 7), (17, 1)), block_size=32, tile_n=16, pad=3),
    Case("headdim80_gqa2_f32", F32, 4, 2, 80, ((5, 6), (20, 1))),
    Case("blockm64_gqa2_f32", F32, 4, 2, 64, ((0, 70), (15, 3), (40, 1)), block_m=64),  # CUDA's prefill tile
    Case("headdim8_gqa2_f32", F32, 4, 2, 8, ((3, 4), (9, 1))),  # padded to the dot minimum of 16
    # GPU only: sizes the interpreter would take minutes over.
    Case("cuda_prefill_gqa2_d128_bf16", BF16, 16, 8, 128,
         ((0, 700), (300, 500), (1000, 1), (0, 1), (2047, 1), (64, 129)), cuda_only=True),
    Case("cuda_decode_gqa4_d64_bf16", BF16, 32, 8, 64,
         tuple((int(c), 1) for c in np.random.default_rng(7).integers(0, 3000, 96)), cuda_only=True),
    Case("cuda_mixed_gqa7_d128_f32", F32, 28, 4, 128, ((0, 300), (700, 77), (1500, 1), (9, 1)), cuda_only=True),
    Case("cuda_mixed_gqa2_d128_f16", F16, 16, 8, 128, ((100, 256), (4000, 1), (0, 33)), block_m=32,
         cuda_only=True),
]



def _random_cases(count: int, seed: int) -> list[Case]:
    """Random ragged batches: a mix of decodes, fresh prefills and chunks with prior context."""
    rng = np.random.default_rng(seed)
    out = []
    for n in range(count):
        qpk = int(rng.choice([1, 3, 4]))
        kvh = int(rng.integers(1, 3))
        dim = int(rng.choice([64, 128]))
        dtype = (F32, BF16)[n % 2]
        reqs = []
        for _ in range(int(rng.integers(1, 6))):
            kind = rng.integers(0, 3)
            ctx = 0 if kind == 1 else int(rng.integers(1, 60))
            reqs.append((ctx, 1 if kind == 0 else int(rng.integers(2, 24))))
        name = f"random{n}_gqa{qpk}_d{dim}_{'f32' if dtype == F32 else 'bf16'}"
        out.append(Case(name, dtype, qpk * kvh, kvh, dim, tuple(reqs)))
    return out


CASES += _random_cases(4, seed=2024)


def cases_for(device: str | None) -> list[Case]:
    return [c for c in CASES if device == "cuda" or not c.cuda_only]


def make_batch(case: Case, device: str, seed: int = 0):
    """A random step: shuffled block ids, random prior cache contents, q/k/v as views of one qkv tensor."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    bs = case.block_size
    ctx = np.array([c for c, _ in case.reqs], dtype=np.int64)
    qlen = np.array([q for _, q in case.reqs], dtype=np.int64)
    seq = ctx + qlen
    nblocks = -(-seq // bs)
    num_blocks = int(nblocks.sum()) + 5
    ids = rng.permutation(np.arange(1, num_blocks))  # 0 stays the null block
    block_table = np.zeros((len(seq), int(nblocks.max())), dtype=np.int32)
    used = 0
    for i, n in enumerate(nblocks):
        block_table[i, :n] = ids[used:used + n]
        used += n
    qsl = np.zeros(len(seq) + 1, dtype=np.int64)
    qsl[1:] = np.cumsum(qlen)
    n_real = int(qsl[-1])
    req = np.repeat(np.arange(len(seq)), qlen)
    pos = ctx[req] + (np.arange(n_real) - qsl[req])
    slots = block_table[req, pos // bs].astype(np.int64) * bs + pos % bs
    slots = np.concatenate([slots, -np.ones(case.pad, dtype=np.int64)])
    num_tokens = n_real + case.pad

    h, kvh, d = case.num_heads, case.num_kv_heads, case.head_dim
    # q/k/v are views of one qkv tensor, with its strides, as the model hands them to attention.
    qkv = torch.randn(num_tokens, (h + 2 * kvh) * d, generator=gen).to(case.dtype).to(device)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.view(-1, h, d), k.view(-1, kvh, d), v.view(-1, kvh, d)
    kv_cache = torch.randn(2, num_blocks, bs, kvh, d, generator=gen).to(case.dtype)

    def meta_for(n: int) -> AttentionMetadata:
        return AttentionMetadata.from_host(slots[:n], qsl, seq, ctx, block_table, bs, device)

    return q, k, v, kv_cache.to(device), meta_for(num_tokens), meta_for(n_real), n_real


def check_case(case: Case, device: str, backend: TritonAttentionBackend | None = None) -> None:
    q, k, v, kv_cache, meta, meta_real, n_real = make_batch(case, device)
    scale = case.head_dim ** -0.5

    ref = TorchAttentionBackend()
    ref_cache = kv_cache.clone()
    meta_real.backend_data = ref.prepare(meta_real)
    ref_out = ref.forward(q[:n_real], k[:n_real], v[:n_real], ref_cache, meta_real, scale)

    tri = backend or TritonAttentionBackend(tile_n=case.tile_n, block_m=case.block_m)
    tri_cache = kv_cache.clone()
    meta.backend_data = tri.prepare(meta)
    tri_out = tri.forward(q, k, v, tri_cache, meta, scale)

    assert tri_out.shape == q.shape and tri_out.dtype == q.dtype
    if not torch.equal(tri_cache, ref_cache):
        bad = (tri_cache != ref_cache).nonzero()
        raise AssertionError(f"{case}: KV cache differs from the reference at {bad.shape[0]} elements, "
                             f"first {bad[0].tolist()}")
    tol = TOLERANCE[case.dtype]
    torch.testing.assert_close(tri_out[:n_real].float(), ref_out.float(), atol=tol, rtol=tol,
                               msg=lambda m: f"{case}: attention output differs from the reference\n{m}")


def run_cases(device: str) -> tuple[int, list[str]]:
    """Every case on `device` without pytest: (number run, failure messages)."""
    failures = []
    selected = cases_for(device)
    for case in selected:
        try:
            check_case(case, device)
            print(f"  ok   {case}", flush=True)
        except Exception as exc:  # noqa: BLE001 - report every case
            failures.append(f"{case}: {type(exc).__name__}: {exc}")
            print(f"  FAIL {case}: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
    return len(selected), failures


if pytest is not None:
    _skip_reason = ("triton was imported before TRITON_INTERPRET was set: run in a fresh process instead"
                    if STALE_TRITON else "TRITON_INTERPRET is off and CUDA is absent")
    needs_device = pytest.mark.skipif(DEVICE is None, reason=_skip_reason)

    @pytest.mark.skipif(not STALE_TRITON, reason="triton kernels are interpreted (or compiled) in this process")
    def test_in_fresh_interpreter_process() -> None:
        root = Path(__file__).resolve().parents[3]
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                              cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]

    @needs_device
    @pytest.mark.parametrize("case", cases_for(DEVICE), ids=str)
    def test_triton_matches_torch_reference(case: Case) -> None:
        check_case(case, DEVICE)

    @needs_device
    def test_backend_selected_by_name() -> None:
        backend = get_attention_backend("triton", torch.device(DEVICE))
        assert backend.name == "triton"
        check_case(CASES[0], DEVICE, backend)

    @needs_device
    def test_store_only_writes_given_slots() -> None:
        """Slots -1 are skipped and nothing but the named slots changes (fp32 and bf16 caches)."""
        for dtype in (F32, BF16):
            cache = torch.randn(2, 6, 16, 2, 64).to(dtype).to(DEVICE)
            k = torch.randn(5, 2, 64).to(dtype).to(DEVICE)
            v = torch.randn(5, 2, 64).to(dtype).to(DEVICE)
            slots = torch.tensor([17, -1, 80, 0, -1], dtype=torch.int64, device=DEVICE)
            expected = cache.clone()
            for t, s in enumerate(slots.tolist()):
                if s >= 0:
                    expected[0].view(-1, 2, 64)[s] = k[t]
                    expected[1].view(-1, 2, 64)[s] = v[t]
            triton_kernels.store_kv(k, v, cache[0], cache[1], slots)
            assert torch.equal(cache, expected)

    def test_kernels_compile_for_hopper() -> None:
        """The compiler (not the interpreter) accepts the kernels: ahead-of-time builds for sm_90 through
        triton's bundled ptxas, in a fresh process without TRITON_INTERPRET. Needs no GPU."""
        pytest.importorskip("triton.backends.nvidia", reason="this triton has no NVIDIA backend")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        code = ("from services.worker.attention import split_kv, triton_kernels; "
                "print('\\n'.join(triton_kernels.compile_for_gpu(90) + split_kv.compile_for_gpu(90)))")
        proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=Path(__file__).resolve().parents[3],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        assert proc.stdout.count(": ok") == 10, proc.stdout

    @needs_device
    def test_cpu_tensors_rejected_when_compiled() -> None:
        if INTERPRETED:
            pytest.skip("interpreted kernels take CPU tensors")
        k = torch.zeros(1, 1, 64)
        cache = torch.zeros(2, 1, 16, 1, 64)
        with pytest.raises(RuntimeError, match="CUDA"):
            triton_kernels.store_kv(k, k, cache[0], cache[1], torch.zeros(1, dtype=torch.int64))

    @needs_device
    def test_engine_greedy_matches_torch_backend(request: pytest.FixtureRequest) -> None:
        """The offline LLM with attention_backend="triton" (chunked prefill, a prefix-cache hit)
        picks the same greedy tokens as with the torch reference backend (tiny random Qwen3, fp32)."""
        if not (Path(__file__).resolve().parents[3] / "models" / "SmolLM2-135M-Instruct" / "tokenizer.json").is_file():
            pytest.skip("the SmolLM2 tokenizer the tiny models borrow is absent (make setup)")
        try:
            from services.common.sampling_params import SamplingParams
            from services.offline.llm import LLM
        except Exception as exc:  # noqa: BLE001 - e.g. transformers or the generated protobuf modules missing
            pytest.skip(f"the engine does not import here: {exc}")
        model_dir = request.getfixturevalue("tiny_qwen3_dir")
        prompts = [list(range(100, 100 + n)) for n in (5, 37, 20)]
        prompts.append(prompts[1][:33] + [7, 8, 9])  # shares two cached blocks with the second prompt
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        results = {}
        for backend in ("torch", "triton"):
            llm = LLM(model_dir, dtype="float32", attention_backend=backend, max_num_batched_tokens=24, block_size=16,
                      max_model_len=256, kv_cache_memory_bytes=32 << 20)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            results[backend] = [list(o.outputs[0].token_ids) for o in outs]
        assert results["triton"] == results["torch"]


# --------------------------------------------------------------------------- split-KV decode

SPLIT_CASES = [  # (case, forced number of splits)
    (Case("split_decode_gqa4_d64_f32", F32, 8, 2, 64, ((300, 1), (5, 1), (129, 1))), 4),
    (Case("split_decode_gqa1_d128_bf16", BF16, 2, 2, 128, ((200, 1), (0, 1))), 3),
    (Case("split_decode_gqa3_d80_f32_bs8", F32, 6, 2, 80, ((97, 1), (40, 1)), block_size=8, tile_n=16), 5),
    (Case("split_decode_gqa2_d64_f16_pad", F16, 4, 2, 64, ((150, 1), (31, 1)), pad=2), 2),
]


if pytest is not None:
    @needs_device
    @pytest.mark.parametrize(("case", "num_splits"), SPLIT_CASES, ids=[str(c) for c, _ in SPLIT_CASES])
    def test_split_kv_decode_matches_torch_reference(case: Case, num_splits: int) -> None:
        """Each request's keys in partitions (more partitions than a short request has tiles: empty
        ones weigh nothing), combined, against the torch attention."""
        check_case(case, DEVICE, TritonAttentionBackend(tile_n=case.tile_n, num_splits=num_splits))

    def test_split_kv_rule() -> None:
        from services.worker.attention.split_kv import MAX_SPLITS, num_splits_for

        assert num_splits_for(8, 512, 132) == 1  # short contexts: the plain kernel
        assert num_splits_for(264, 32768, 132) == 1  # enough programs to fill the GPU
        assert num_splits_for(8, 32768, 132) == MAX_SPLITS  # 17 would fill it: capped
        assert num_splits_for(33, 8192, 132) == 4  # 4 x 33 programs cover 132 multiprocessors
        assert num_splits_for(8, 1024, 132) == 4  # partitions of at least 256 keys

    @needs_device
    def test_the_backend_splits_long_decodes_by_the_rule() -> None:
        case = Case("split_rule_gqa2_d64_f32", F32, 4, 2, 64, ((1100, 1), (7, 1)), block_size=64, tile_n=64)
        backend = TritonAttentionBackend(tile_n=64)
        plan = backend.prepare(make_batch(case, DEVICE)[4])
        assert backend.splits(plan, 2, torch.device(DEVICE)) == 4  # 4 programs, 1100 keys: partitions of 256+
        check_case(case, DEVICE, backend)
