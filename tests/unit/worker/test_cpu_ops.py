"""The fused CPU ops (services/worker/cpu/cpu_ops.c) against HF transformers' eager arithmetic in torch."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from support.isa_levels import levels_here

from services.worker.cpu import cpu_ops
from services.worker.cpu.cpu_ops import CpuOps

ops = CpuOps.load()
# Only a machine without a C compiler may skip: a build failure where one exists is a failure.
pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(autouse=True)
def _built() -> None:
    assert ops is not None, "cpu_ops.c did not build (see the warning logged above)"
EPS = 1e-5


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    return w * x32.to(x.dtype)


def hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: a few ulps (sum order, exp's last bits). bf16: the same roundings as HF, so at most
    one bf16 step apart, and only where an fp32 intermediate sat on a rounding boundary."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-30)
        return
    step = (want.float().abs() * 2.0 ** -7).clamp_min(1e-30)
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= step * 1.01).all()), float((diff / step).max())
    assert float((diff > 0).float().mean()) < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_and_fused_residual_add(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    x = (torch.randn(rows, 576) * 3).to(dtype)
    w = (torch.rand(576) + 0.5).to(dtype)
    assert_close(ops.rms_norm(x, w, EPS), hf_rms_norm(x, w))
    # A strided view of rows (as RoPE's input would be) reads the same values.
    wide = torch.randn(rows, 1000).to(dtype)
    wide[:, :576] = x
    assert_close(ops.rms_norm(wide[:, :576], w, EPS), hf_rms_norm(x, w))

    delta = torch.randn(rows, 576).to(dtype)
    residual = x.clone()
    h = delta.clone()
    ops.fused_add_rms_norm(h, residual, w, EPS)
    want_residual = x + delta
    assert torch.equal(residual, want_residual)  # the add rounds exactly as torch's
    assert_close(h, hf_rms_norm(want_residual, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64])
def test_silu_and_mul(dtype: torch.dtype, rows: int) -> None:
    """Against HF's two ops (the first 8 values: specials), at the best level this CPU runs."""
    torch.manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536) * 4).to(dtype)
    gate_up[0, :8] = torch.tensor([0.0, -100.0, 100.0, -88.5, 88.5, 1e-30, -1e-30, 20.0]).to(dtype)
    gate, up = gate_up.split(1536, dim=-1)
    assert_close(ops.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_isa_level_computes_the_same_bits(dtype: torch.dtype) -> None:
    """The library at each instruction-set level this CPU runs (the AVX-512 build's 16-lane SiLU
    loop, the AVX2 build's 8 lanes) gives bit-identical results for every op: the same arithmetic
    per element, whatever the width. The sizes leave tails for the narrower loops: 1,045 = 32 x 32
    + 2 x 8 + 5."""
    levels = levels_here(cpu_ops.HIGHEST_ISA)
    if len(levels) < 2:
        pytest.skip(f"this CPU runs only {levels} of the levels with code of their own")
    builds = [CpuOps.build(level) for level in levels]
    torch.manual_seed(0)
    gate_up = (torch.randn(37, 2 * 1045) * 4).to(dtype)
    x, w = torch.randn(37, 576 + 13).to(dtype), torch.randn(576 + 13).to(dtype)
    results = [(b.silu_and_mul(gate_up), b.rms_norm(x, w, EPS)) for b in builds]
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_on_the_qk_columns_of_a_fused_qkv_row(dtype: torch.dtype) -> None:
    from services.worker.models.layers import RotaryEmbedding

    torch.manual_seed(0)
    heads, kv_heads, d = 9, 3, 64
    rope = RotaryEmbedding(d, 2048, 10000.0, None)
    tokens = 37
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d).to(dtype)
    positions = torch.randint(0, 2048, (tokens,), dtype=torch.int64)
    qk = qkv[:, :(heads + kv_heads) * d].unflatten(-1, (heads + kv_heads, d))
    want = hf_rope(qk, *rope.lookup(positions, dtype))
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    ops.rope_neox_(qkv, heads + kv_heads, d, positions, rope.cos, rope.sin)
    got = qkv[:, :(heads + kv_heads) * d].unflatten(-1, (heads + kv_heads, d))
    if dtype == torch.float32:
        assert torch.equal(got, want)  # same products, same sum, no fused multiply-add
    else:
        assert_close(got, want)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_before)  # V untouched


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_model_with_fused_ops_scores_prompts_as_the_torch_ops_do(tiny_model_dir, monkeypatch, arch: str,
                                                                     dtype: str) -> None:
    """The whole model through the engine, fused CPU ops on and off: every prompt position's
    top logprobs agree (qwen2: q/k/v biases, untied head; qwen3: q/k norms before the in-place
    RoPE, tied head), chunked prefill included."""
    from services.common.sampling_params import SamplingParams
    from services.offline import LLM
    from services.worker.models import fast_paths

    model_dir = tiny_model_dir(arch)
    prompts = [[(7 * i + 3 * j) % 500 + 100 for j in range(n)] for i, n in enumerate((5, 40, 77))]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)

    def score(fused: bool) -> list:
        if not fused:
            monkeypatch.setattr(fast_paths, "use_cpu_ops", lambda model: False)
        llm = LLM(model_dir, seed=0, dtype=dtype, max_num_batched_tokens=48)
        assert (fast_paths.cpu_ops(llm.worker.runner.model) is not None) == fused
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.close()
        return [r.prompt_logprobs[1:] for r in results]

    fused, plain = score(True), score(False)
    tol = 1e-4 if dtype == "float32" else 0.1
    for got_prompt, want_prompt in zip(fused, plain, strict=True):
        for got, want in zip(got_prompt, want_prompt, strict=True):
            top = max(want, key=lambda t: want[t].logprob)
            assert top in got and abs(got[top].logprob - want[top].logprob) <= tol


def test_bf16_residual_add_rounds_specials_and_ties_like_torch() -> None:
    """The bf16 rows go 16 values at a time through the split load/store (vec.h): NaN, infinities,
    values that round to infinity and exact ties between two bf16 neighbours come out as torch's."""
    torch.manual_seed(0)
    x = torch.randn(3, 576).to(torch.bfloat16)
    delta = torch.randn(3, 576).to(torch.bfloat16)
    inf, nan, tie_down, tie_up = float("inf"), float("nan"), 2.0 ** -8, 3 * 2.0 ** -8
    # each special at an even and an odd position (the split path's two halves)
    x[0, :12] = torch.tensor([nan, nan, inf, inf, -inf, -inf, 3e38, 3e38, 1, 1, 1, 1]).to(torch.bfloat16)
    delta[0, :12] = torch.tensor([1, 1, 1, 1, 1, 1, 3e38, 3e38, tie_down, tie_down, tie_up, tie_up]).to(torch.bfloat16)
    residual, h = x.clone(), delta.clone()
    ops.fused_add_rms_norm(h, residual, (torch.rand(576) + 0.5).to(torch.bfloat16), EPS)
    torch.testing.assert_close(residual, x + delta, rtol=0, atol=0, equal_nan=True)
    assert residual[0, 6:8].isinf().all()
    assert residual[0, 8:10].eq(1.0).all() and residual[0, 10:12].eq(1.015625).all()  # ties to even


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [5, 16, 1045, 49152])
def test_argmax_is_torch_max_index_with_ties_nans_and_infinities(dtype: torch.dtype, cols: int) -> None:
    """The greedy sampler's argmax: torch.max(dim=-1)'s index at every instruction-set level,
    for plain rows, rows of ties (the first wins; bf16 rounding makes many), a NaN (the first
    NaN wins over any value), all -inf, signed zeros, a maximum in the row's tail, and rows
    read through a stride."""
    torch.manual_seed(cols)
    x = (torch.randn(12, cols) * 3).to(dtype)
    x[1] = x[1].round()  # many equal values: ties everywhere
    x[2, cols // 2] = float("nan")
    x[2, cols - 1] = float("nan")
    x[2, 0] = float("inf")
    x[3] = float("-inf")
    x[4] = 0.0
    x[4, cols // 3] = -0.0
    x[5, cols - 1] = 100.0  # in the tail past the last full 16-value block
    x[6, 0] = x[6, cols - 1] = 100.0
    x[7, :] = 1.0
    x[8, min(3, cols - 1)] = float("inf")
    x[8, cols - 1] = float("inf")
    want = torch.max(x, dim=-1).indices
    for level in levels_here(cpu_ops.HIGHEST_ISA):
        build = CpuOps.build(level)
        assert torch.equal(build.argmax(x), want), level
        wide = torch.zeros(12, cols + 7, dtype=dtype)
        wide[:, :cols] = x
        assert torch.equal(build.argmax(wide[:, :cols]), want), level


def test_greedy_sampler_takes_the_c_argmax_on_cpu(monkeypatch) -> None:
    """greedy_ids runs the C kernel for CPU logits (and only falls back to torch.max elsewhere)."""
    from services.worker import sampler

    calls = []
    monkeypatch.setattr(CpuOps, "argmax", lambda self, logits: calls.append(logits.shape) or torch.max(logits, -1)[1])
    logits = torch.randn(3, 100)
    assert torch.equal(sampler.greedy_ids(logits), torch.max(logits, dim=-1).indices)
    assert calls == [(3, 100)]
