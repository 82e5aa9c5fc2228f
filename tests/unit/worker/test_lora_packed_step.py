"""LoRA adapters inside the whole-step C kernel (models/c_step/packed_step.c, lora_step.h): a step
whose tokens use adapters (three slots, base tokens among them; decodes, prefill chunks, both)
gives the eager layers' hidden states (lora/apply.py's products), base tokens exactly what the
step gives without adapters, and the adapters change the adapted tokens."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from support.packed_step_cases import packed_step_or_skip, step_meta
from support.runners import runner_for

from services.worker.attention.base import forward_context
from services.worker.lora.adapter import LoraAdapter
from services.worker.lora.slots import GROUPS
from services.worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler")

BLOCK = 16
NUM_BLOCKS = 12 * 40 + 1
MAX_LORAS, MAX_RANK = 3, 8

# (cached tokens, new tokens, slot) per request: decodes of 1, 5 and 40 requests, prefill chunks
# alone and among decodes
CASES = [
    (np.array([9]), np.array([1]), np.array([1])),
    (np.array([5, 28, 51, 74, 97]), np.ones(5, np.int64), np.array([0, -1, 2, 1, 0])),
    (np.array([5 + (23 * i) % 180 for i in range(40)]), np.ones(40, np.int64), np.arange(40) % 4 - 1),
    (np.array([0, 20, 40]), np.array([37, 16, 5]), np.array([2, -1, 0])),
    (np.array([30, 7, 100, 64, 0, 9]), np.array([1, 1, 1, 1, 33, 70]), np.array([-1, 0, 1, 2, 1, -1])),
]


def _load_adapters(runner: ModelRunner) -> None:
    """Slot s holds an adapter of rank 8 - 2s on every module but s's own leftovers (slot 1: no
    MLP; slot 2: attention only on q and v)."""
    gen = torch.Generator().manual_seed(1)
    modules = [m for group in GROUPS.values() for m in group]
    chosen = [modules, ["q_proj", "k_proj", "v_proj", "o_proj"], ["q_proj", "v_proj"]]
    for slot in range(MAX_LORAS):
        rank = MAX_RANK - 2 * slot
        weights = {}
        for layer in range(runner.lora.num_layers):
            for m in chosen[slot]:
                shape = runner.lora.shapes[m]
                weights[layer, m] = (0.05 * torch.randn(rank, shape.in_features, generator=gen),
                                     0.05 * torch.randn(shape.out_features, rank, generator=gen))
        adapter = LoraAdapter(slot + 1, rank, {k: (a.to(runner.dtype), b.to(runner.dtype))
                                               for k, (a, b) in weights.items()})
        runner.lora.slots.load(slot, adapter)


def _hidden(runner: ModelRunner, ids: torch.Tensor, ctx: np.ndarray, num_new: np.ndarray,
            token_slots: np.ndarray | None) -> torch.Tensor:
    meta = step_meta(runner, ctx, num_new)
    meta.lora = runner.lora.batch(token_slots) if token_slots is not None else None
    pos = torch.from_numpy(np.concatenate([np.arange(c, c + n) for c, n in zip(ctx, num_new, strict=True)]))
    with torch.inference_mode(), forward_context(runner.attn_backend, meta):
        return runner.model(ids, pos)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_packed_step_adds_the_adapters_as_the_eager_layers(tiny_model_dir, arch: str, dtype: str) -> None:
    runner = runner_for(tiny_model_dir(arch), dtype=dtype, seed=0, enable_lora=True, max_loras=MAX_LORAS,
                        max_lora_rank=MAX_RANK)
    runner.init_kv_cache(NUM_BLOCKS, BLOCK)
    step = packed_step_or_skip(runner)
    assert step.runs_lora()
    _load_adapters(runner)
    runner.model.decode_step = None  # (a LoRA step never takes it; without adapters it would)
    calls: list[int] = []
    original = step.forward
    step.forward = lambda *a: calls.append(1) or original(*a)
    gen = torch.Generator().manual_seed(0)
    vocab = runner.config.vocab_size
    for ctx, num_new, req_slots in CASES:
        token_slots = np.repeat(req_slots, num_new).astype(np.int32)
        setup = np.maximum(ctx, 1)
        _hidden(runner, torch.randint(0, vocab, (int(setup.sum()),), generator=gen), np.zeros(len(ctx), np.int64),
                setup, None)
        ids = torch.randint(0, vocab, (int(num_new.sum()),), generator=gen)
        before = len(calls)
        got = _hidden(runner, ids, ctx, num_new, token_slots)
        assert len(calls) == before + 1  # the packed step ran it
        without = _hidden(runner, ids, ctx, num_new, None)
        runner.model.packed_step = None
        want = _hidden(runner, ids, ctx, num_new, token_slots)
        runner.model.packed_step = step
        base = torch.from_numpy(token_slots < 0)
        # a base token's projections get exactly zero added: the same as a step without adapters
        assert torch.equal(got[base], without[base])
        adapted = ~base
        scale = float(want.float().abs().max())
        assert float((got[adapted].float() - without[adapted].float()).abs().max()) > 0.02 * scale
        if dtype == "float32":
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * scale)
        else:  # other orders of sums flip a few bf16 roundings
            torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.03 * scale)
