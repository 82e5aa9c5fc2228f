"""The Triton elementwise ops (services/worker/models/triton_ops.py, `layer_ops.TritonOps`) against
the torch reference (`TorchOps`): fused add + RMSNorm, RMSNorm, RoPE in place on the fused qkv
rows, SiLU·mul, and a whole tiny model's logits.

Without CUDA the kernels run under TRITON_INTERPRET=1 on CPU tensors (small sizes: the
interpreter is slow); with CUDA, compiled on the GPU (`scripts/gpu_check.sh` runs this file).

Tolerances: fp32 1e-5. The kernels round to bf16/fp16 exactly where the torch code does (see
triton_ops.py), so a result differs from the reference only where another fp32 summation order
(the norm's mean of squares) or a GPU's exp/rsqrt tips one rounding: then by an ulp or two. So
bf16/fp16 results must agree within 2 ulps (2 * finfo.eps relative, and absolute at the
operands' scale, which a rounded product carries into a difference) and at most 1% of the
elements may differ at all: a rounding point left out or added moves far more (under the
interpreter none differ).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from support.triton_device import DEVICE, ROOT, fresh_process_only, needs_device, run_in_fresh_interpreter

from services.worker.models import triton_ops
from services.worker.models.layer_ops import TORCH_OPS, TritonOps
from services.worker.models.layers import RMSNorm, RotaryEmbedding

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DTYPES = pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])


def assert_matches(got: torch.Tensor, want: torch.Tensor, scale: float = 1.0, what: str = "") -> None:
    """got == want within the module docstring's tolerances; `scale`: the operands' magnitude."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    got, want = got.cpu(), want.cpu()
    if got.dtype == F32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}\n{m}")
        return
    eps = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * eps, atol=2 * eps * max(1.0, scale),
                               msg=lambda m: f"{what}\n{m}")
    differ = (got != want).float().mean().item()
    assert differ <= 0.01, f"{what}: {differ:.2%} of the elements differ from the reference"


def _norm(width: int, dtype: torch.dtype, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(width, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.5 * torch.randn(width, generator=gen))
    return norm.to(dtype=dtype, device=DEVICE)


def _randn(*shape: int, gen: torch.Generator, dtype: torch.dtype, std: float = 1.0) -> torch.Tensor:
    return (std * torch.randn(*shape, generator=gen)).to(dtype).to(DEVICE)


@fresh_process_only
def test_in_fresh_interpreter_process() -> None:
    run_in_fresh_interpreter(__file__, timeout_s=600)


SHAPES = pytest.mark.parametrize(("rows", "width"), [(1, 576), (7, 576), (3, 100)])  # 576: SmolLM2's hidden


@needs_device
@DTYPES
@SHAPES
def test_rms_norm(dtype: torch.dtype, rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * width)
    norm = _norm(width, dtype, gen)
    x = _randn(rows, width, gen=gen, dtype=dtype, std=3.0)
    before = x.clone()
    got = TritonOps().rms_norm(x, norm)
    assert got.data_ptr() != x.data_ptr() and torch.equal(x, before)  # a new tensor
    assert_matches(got, TORCH_OPS.rms_norm(x, norm), what="rms_norm")


@needs_device
@DTYPES
@SHAPES
def test_fused_add_rms_norm_writes_both_in_place(dtype: torch.dtype, rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows + width)
    norm = _norm(width, dtype, gen)
    x = _randn(rows, width, gen=gen, dtype=dtype)
    residual = _randn(rows, width, gen=gen, dtype=dtype, std=3.0)
    want_x, want_residual = TORCH_OPS.add_rms_norm(x, residual, norm)
    got_x, got_residual = TritonOps().add_rms_norm(x, residual, norm)
    assert got_x is x and got_residual is residual
    assert_matches(residual, want_residual, scale=4.0, what="residual")
    assert_matches(x, want_x, what="normed")


@needs_device
def test_norm_rows_of_a_wider_tensor() -> None:
    """Row strides other than the width (a view of every other row) and a 3-D input."""
    gen = torch.Generator().manual_seed(5)
    norm = _norm(64, F32, gen)
    base = _randn(6, 64, gen=gen, dtype=F32)
    assert_matches(triton_ops.rms_norm(base[::2], norm.weight, norm.eps), norm(base[::2]))
    x3 = _randn(2, 3, 64, gen=gen, dtype=F32)
    assert_matches(triton_ops.rms_norm(x3, norm.weight, norm.eps), norm(x3))
    store = _randn(12, 64, gen=gen, dtype=F32)
    residual = store[::2]  # rows 128 elements apart
    x = base.clone()
    want_x, want_r = TORCH_OPS.add_rms_norm(x.clone(), residual.clone(), norm)
    triton_ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    assert_matches(x, want_x)
    assert_matches(store[::2], want_r)


def _rope_reference(qk: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, num_heads: int,
                    head_dim: int, is_neox: bool, rotary_dim: int) -> torch.Tensor:
    """HF's arithmetic in the tensor's dtype (cos/sin rounded to it, each product rounded), for either
    pairing and a partial rotary width."""
    half = rotary_dim // 2
    x = qk[:, :num_heads * head_dim].unflatten(-1, (num_heads, head_dim)).clone()
    cos = rope.cos[positions, :half].to(qk.dtype)[:, None]
    sin = rope.sin[positions, :half].to(qk.dtype)[:, None]
    first, second = ((slice(0, half), slice(half, rotary_dim)) if is_neox
                     else (slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)))
    x1, x2 = x[..., first].clone(), x[..., second].clone()
    x[..., first] = x1 * cos - x2 * sin
    x[..., second] = x2 * cos + x1 * sin
    return x


ROPE_CASES = pytest.mark.parametrize(("tokens", "q_heads", "kv_heads", "head_dim"),
                                     [(1, 4, 2, 64), (9, 6, 2, 64), (5, 3, 1, 80)])


@needs_device
@DTYPES
@ROPE_CASES
def test_rope_in_place_on_qkv(dtype: torch.dtype, tokens: int, q_heads: int, kv_heads: int, head_dim: int) -> None:
    """TritonOps.rope against TorchOps.rope (neox, the project's RotaryEmbedding): q and k heads
    rotated in the qkv tensor itself, the v columns untouched."""
    gen = torch.Generator().manual_seed(tokens * head_dim)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None)
    rope.reset_tables(DEVICE or "cpu")
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(DEVICE)
    qkv = _randn(tokens, (q_heads + 2 * kv_heads) * head_dim, gen=gen, dtype=dtype)
    before = qkv.clone()
    heads = q_heads + kv_heads
    want = TORCH_OPS.rope(before, heads, head_dim, TORCH_OPS.rope_state(rope, positions, dtype))
    ops = TritonOps()
    got = ops.rope(qkv, heads, head_dim, ops.rope_state(rope, positions, dtype))
    assert got.shape == (tokens, heads, head_dim) and got.data_ptr() == qkv.data_ptr()
    assert torch.equal(qkv[:, heads * head_dim:], before[:, heads * head_dim:])  # v
    assert_matches(got, want, scale=4.0, what="rope")
    assert_matches(qkv[:, :heads * head_dim].view_as(want), want, scale=4.0, what="rope in qkv")


@needs_device
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("is_neox", "rotary_dim"), [(False, 64), (True, 32), (False, 48)])
def test_rope_gptj_and_partial_rotary(dtype: torch.dtype, is_neox: bool, rotary_dim: int) -> None:
    """The kernel's other forms (no model here uses them yet): GPT-J's interleaved pairs and a
    rotary width below the head's; the rest of each head is left as it was."""
    tokens, heads, head_dim = 6, 5, 64
    gen = torch.Generator().manual_seed(rotary_dim)
    rope = RotaryEmbedding(rotary_dim, 512, 10000.0, None)
    rope.reset_tables(DEVICE or "cpu")
    positions = torch.randint(0, 512, (tokens,), generator=gen).to(DEVICE)
    qk = _randn(tokens, (heads + 1) * head_dim, gen=gen, dtype=dtype)
    want = _rope_reference(qk, positions, rope, heads, head_dim, is_neox, rotary_dim)
    before = qk.clone()
    triton_ops.rope_(qk, positions, rope.cos, rope.sin, heads, head_dim, is_neox=is_neox, rotary_dim=rotary_dim)
    got = qk[:, :heads * head_dim].view_as(want)
    assert_matches(got, want, scale=4.0, what="rope")
    assert torch.equal(got[..., rotary_dim:], before[:, :heads * head_dim].view_as(want)[..., rotary_dim:])
    assert torch.equal(qk[:, heads * head_dim:], before[:, heads * head_dim:])


@needs_device
@DTYPES
@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (6, 100)])  # 1536: SmolLM2's intermediate (2 blocks)
def test_silu_and_mul(dtype: torch.dtype, rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * width)
    gate_up = _randn(rows, 2 * width, gen=gen, dtype=dtype, std=2.0)
    before = gate_up.clone()
    got = TritonOps().silu_and_mul(gate_up)
    assert torch.equal(gate_up, before)
    assert_matches(got, TORCH_OPS.silu_and_mul(gate_up), scale=8.0, what="silu_and_mul")


@needs_device
def test_empty_batches() -> None:
    ops, gen = TritonOps(), torch.Generator().manual_seed(0)
    norm = _norm(64, F32, gen)
    x = torch.empty(0, 64, device=DEVICE)
    assert ops.rms_norm(x, norm).shape == (0, 64)
    assert ops.add_rms_norm(x, x.clone(), norm)[0].shape == (0, 64)
    assert ops.silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)


def _model_logits(model, ids: torch.Tensor, positions: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Prefill of requests of `lens` tokens through the torch attention backend (fresh KV caches)."""
    from services.worker.attention.base import AttentionMetadata, forward_context
    from services.worker.attention.torch_backend import TorchAttentionBackend

    block = 16
    dtype = next(model.parameters()).dtype
    for layer in model.attention_layers():
        layer.kv_cache = torch.zeros(2, len(lens) + 1, block, layer.num_kv_heads, layer.head_dim, dtype=dtype,
                                     device=DEVICE)
    seq = np.array(lens)
    qsl = np.concatenate([[0], np.cumsum(seq)])
    block_table = np.arange(1, len(lens) + 1, dtype=np.int32)[:, None]  # request i: block i + 1
    slots = np.concatenate([(i + 1) * block + np.arange(n) for i, n in enumerate(lens)])
    meta = AttentionMetadata.from_host(slots, qsl, seq, np.zeros_like(seq), block_table, block, DEVICE)
    backend = TorchAttentionBackend()
    meta.backend_data = backend.prepare(meta)
    with torch.inference_mode(), forward_context(backend, meta):
        return model.compute_logits(model(ids, positions))


@needs_device
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@DTYPES
def test_tiny_model_logits_match_torch_ops(arch: str, dtype: torch.dtype, request: pytest.FixtureRequest) -> None:
    """A whole tiny model (2 layers; qwen3: q/k norms before the in-place RoPE, tied head) over two
    prompts: TritonOps gives TorchOps' logits (fp32 1e-4 after two layers; bf16/fp16: the same
    rounding points, so within a few ulps of the logits' scale; under the interpreter bitwise).
    The tiny checkpoints where the SmolLM2 one (their tokenizer) is here, else the same configs
    with torch's random init."""
    pytest.importorskip("transformers", reason="the tiny models' configs are transformers configs")
    from services.worker.models.fast_paths import use_fused_ops

    if (ROOT / "models" / "SmolLM2-135M-Instruct" / "model.safetensors").is_file():
        from services.worker.models.load import load_model

        model, _ = load_model(request.getfixturevalue("tiny_model_dir")(arch), dtype, torch.device(DEVICE),
                              progress=False)
    else:  # e.g. on a GPU machine with only this repository (scripts/gpu_check.sh)
        from conftest import _tiny_config

        from services.worker.models.llama import LlamaForCausalLM
        from services.worker.models.qwen3 import Qwen3ForCausalLM

        torch.manual_seed(0)
        model = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}[arch](_tiny_config(arch))
        model = model.to(device=DEVICE, dtype=dtype).eval()
        model.rotary_emb.reset_tables(DEVICE)  # fp32 tables, as load_model makes them
    if DEVICE == "cuda":
        assert use_fused_ops(model) and isinstance(model.fused_ops, TritonOps)
    lens = [5, 3]
    ids = torch.tensor([(37 * i) % 400 + 50 for i in range(sum(lens))], device=DEVICE)
    positions = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
    model.fused_ops = None
    want = _model_logits(model, ids, positions, lens)
    model.fused_ops = TritonOps()
    got = _model_logits(model, ids, positions, lens)
    scale = want.abs().max().item()
    tol = 1e-4 if dtype == F32 else 4 * torch.finfo(dtype).eps
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale)


def test_backend_choice() -> None:
    """TritonOps for CUDA parameters of the kernels' dtypes only; on the CPU the model keeps its C
    ops (or torch's)."""
    assert not TritonOps.supports(torch.zeros(1))
    assert not TritonOps.supports(torch.zeros(1, dtype=torch.float64))
    if torch.cuda.is_available():
        assert TritonOps.supports(torch.zeros(1, dtype=BF16, device="cuda"))
        assert not TritonOps.supports(torch.zeros(1, dtype=torch.float64, device="cuda"))

    pytest.importorskip("transformers", reason="the tiny model's config is a transformers config")
    from conftest import _tiny_config

    from services.worker.models.fast_paths import cpu_ops, use_fused_ops
    from services.worker.models.layer_ops import FusedCpuOps
    from services.worker.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(_tiny_config("llama"))
    use_fused_ops(model)
    assert model.fused_ops is None or isinstance(model.fused_ops, FusedCpuOps)
    assert cpu_ops(model) is model.fused_ops


def test_layer_ops_imports_without_triton() -> None:
    """A CPU-only import of layer_ops (and making its CPU backends) never imports triton."""
    code = ("import sys; import services.worker.models.layer_ops as m; m.TorchOps(); "
            "assert 'triton' not in sys.modules, 'triton imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_kernels_compile_for_hopper() -> None:
    """The compiler (not the interpreter) accepts the kernels: ahead-of-time builds for sm_90 in a
    fresh process without TRITON_INTERPRET. Needs no GPU."""
    pytest.importorskip("triton.backends.nvidia", reason="this triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from services.worker.models.triton_ops import compile_for_gpu; print('\\n'.join(compile_for_gpu(90)))"
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count(": ok") == 15, proc.stdout
