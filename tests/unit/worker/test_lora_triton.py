"""The Triton BGMV kernels (services/worker/lora/triton_lora.py) against the dense masked GEMMs of
services/worker/lora/apply.py on the same slot table: every fused group, tokens of several slots
and base-only ones mixed, ranks below the tile, fp32 and bf16. Without CUDA the kernels run under
TRITON_INTERPRET=1 on CPU tensors (small shapes: the interpreter is slow)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.triton_device import DEVICE, fresh_process_only, needs_device, run_in_fresh_interpreter

from services.worker.lora import triton_lora
from services.worker.lora.adapter import LoraAdapter, ModuleShape
from services.worker.lora.slots import GROUPS, LoraSlots

SHAPES = {"q_proj": ModuleShape(48, 48), "k_proj": ModuleShape(48, 16), "v_proj": ModuleShape(48, 16),
          "o_proj": ModuleShape(48, 48), "gate_proj": ModuleShape(48, 80), "up_proj": ModuleShape(48, 80),
          "down_proj": ModuleShape(80, 48)}


@fresh_process_only
def test_in_fresh_interpreter_process() -> None:
    run_in_fresh_interpreter(__file__)


@needs_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bgmv_kernels_match_the_dense_masked_products(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    slots = LoraSlots(1, 3, 6, SHAPES, dtype, torch.device("cpu"))
    for slot, (rank, modules) in enumerate([(6, tuple(SHAPES)), (3, ("q_proj", "v_proj", "up_proj", "down_proj"))]):
        weights = {(0, m): (torch.randn(rank, SHAPES[m].in_features, generator=gen).to(dtype),
                            torch.randn(SHAPES[m].out_features, rank, generator=gen).to(dtype)) for m in modules}
        slots.load(slot, LoraAdapter(slot + 1, rank, weights))
    token_slots = np.array([0, -1, 1, 1, 0, -1, 1], dtype=np.int32)
    batch = slots.batch(token_slots)
    for group, modules in GROUPS.items():
        table = slots.groups[group]
        x = torch.randn(len(token_slots), SHAPES[modules[0]].in_features, generator=gen).to(dtype)
        y = torch.randn(len(token_slots), table.b.shape[1], generator=gen).to(dtype)
        expected = slots.layer(0).add(group, y.clone(), x, batch)
        got = triton_lora.add_lora(y.clone().to(DEVICE), x.to(DEVICE), table.a[0].to(DEVICE), table.b[0].to(DEVICE),
                                   torch.from_numpy(token_slots).to(DEVICE), table.columns, 3, 6).cpu()
        # bf16: the dense path rounds the shrunk values to bf16, the kernels keep them in fp32.
        tol = 1e-4 if dtype == torch.float32 else 2e-2 * float(expected.float().abs().max())
        assert torch.allclose(got.float(), expected.float(), rtol=1e-4, atol=tol), group
        assert torch.equal(got[token_slots < 0], y[token_slots < 0])
