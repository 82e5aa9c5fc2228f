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


def test_a_request_left_out_for_its_adapter_is_skipped_in_the_step_already_scheduled(tiny_model_dir,
                                                                                    tmp_path) -> None:
    """Async scheduling: the step after the one whose adapter failed was scheduled before the
    failure was reported and continues the request as one the worker holds. The worker skips it
    there (the other requests run) instead of refusing the whole step."""
    from services.common.proto import myvllm_pb2 as pb

    runner = runner_for(tiny_model_dir("llama"), dtype="float32", seed=0, enable_lora=True, max_loras=2,
                        max_lora_rank=8)
    runner.init_kv_cache(NUM_BLOCKS, BLOCK)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj"], "lora_alpha": 8}')
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    sp = pb.SamplingParams(temperature=0.0, max_tokens=8)
    lora = pb.LoRARequest(lora_name="broken", lora_int_id=5, lora_path=str(broken))
    first = pb.SchedulerOutput(step_id=1, new_requests=[
        pb.NewRequestData(request_id="good", prompt_token_ids=[5, 6, 7, 8], sampling=sp, block_ids=[1]),
        pb.NewRequestData(request_id="bad", prompt_token_ids=[5, 6, 7, 8], sampling=sp, block_ids=[2],
                          lora_request=lora, lora_slot=0)], num_scheduled_tokens=[4, 4])
    out = runner.execute(first)
    assert [f.request_id for f in out.lora_load_failures] == ["bad"]
    assert list(out.request_ids) == ["good"]
    second = pb.SchedulerOutput(step_id=2, cached_requests=[
        pb.CachedRequestData(request_id="good", num_computed_tokens=4),
        pb.CachedRequestData(request_id="bad", num_computed_tokens=4)], num_scheduled_tokens=[1, 1])
    out = runner.execute(second)
    assert list(out.request_ids) == ["good"] and not out.lora_load_failures
    # a request id the worker never left out is still refused as unknown
    third = pb.SchedulerOutput(step_id=3, cached_requests=[
        pb.CachedRequestData(request_id="other", num_computed_tokens=4)], num_scheduled_tokens=[1])
    with pytest.raises(Exception, match="cached_requests"):
        runner.execute(third)
