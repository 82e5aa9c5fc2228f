"""oneDNN-prepacked linear layers (services/worker/models/cpu_linear.py) and the opaque op a
compiled forward calls them through."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.worker import opaque_ops
from services.worker.models import cpu_linear
from services.worker.models.cpu_linear import PackedLinear, pack_linears

BF16_PACKABLE = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # AVX-512 or AVX-NE-CONVERT CPUs


def test_available_for_the_pinned_torch() -> None:
    assert cpu_linear.available(torch.float32)
    assert cpu_linear.available(torch.bfloat16) == BF16_PACKABLE  # oneDNN refuses bf16 on AVX2-only CPUs
    assert not cpu_linear.available(torch.float16)


def test_bf16_layers_stay_plain_where_onednn_cannot_pack_them(tiny_llama_dir: str) -> None:
    from services.worker.models.fast_paths import pack_for_cpu
    from services.worker.models.load import load_model

    model, _ = load_model(tiny_llama_dir, torch.bfloat16, torch.device("cpu"), progress=False)
    assert pack_for_cpu(model) == BF16_PACKABLE
    assert any(isinstance(m, nn.Linear) for m in model.modules()) != BF16_PACKABLE

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not BF16_PACKABLE, reason="oneDNN cannot pack bf16 weights on this CPU (AVX2 only)"))])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, bias: bool, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias).to(dtype)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    expected = F.linear(x, linear.weight, linear.bias)
    got = PackedLinear.from_linear(linear)(x)
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_pack_linears_swaps_every_linear() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    x = torch.randn(3, 8)
    expected = model(x)
    assert pack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_opaque_op_resolves_in_the_active_table() -> None:
    model = nn.Sequential(PackedLinear(torch.randn(5, 3), None), PackedLinear(torch.randn(2, 3), torch.randn(2)))
    table = opaque_ops.assign(model)
    assert [m.opaque_index for m in table] == [0, 1]
    x = torch.randn(4, 3)
    with opaque_ops.active(table):
        got = torch.ops.myvllm.packed_linear(x, 1)
    torch.testing.assert_close(got, model[1].matmul(x))
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.myvllm.packed_linear(x, 0)
