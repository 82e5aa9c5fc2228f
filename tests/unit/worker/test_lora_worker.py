"""The worker's LoRA parts without a model run: the step boundary's checks of a request's adapter
fields, the slot table (a slot refilled with another adapter keeps nothing of the old one), the
per-token slot mask, and the adapters' products (dense masked GEMMs, torch's and the packed GEMM's)
against a per-token reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.proto import myvllm_pb2 as pb
from services.worker.input_batch import InputBatch
from services.worker.lora.adapter import LoraAdapter, ModuleShape
from services.worker.lora.apply import BGMV_MAX_ROWS, PACKED_GEMM_MAX_ROWS, LoraBatch
from services.worker.lora.slots import GROUPS, LoraSlots
from services.worker.step_validation import InvalidStep, validate_step

SHAPES = {"q_proj": ModuleShape(64, 64), "k_proj": ModuleShape(64, 32), "v_proj": ModuleShape(64, 32),
          "o_proj": ModuleShape(64, 64), "gate_proj": ModuleShape(64, 96), "up_proj": ModuleShape(64, 96),
          "down_proj": ModuleShape(96, 64)}
LAYERS, SLOTS, MAX_RANK = 2, 4, 8


def _step(lora: pb.LoRARequest | None, slot: int = 0) -> pb.SchedulerOutput:
    r = pb.NewRequestData(request_id="a", prompt_token_ids=[1, 2, 3, 4], block_ids=[1], lora_request=lora,
                          lora_slot=slot)
    return pb.SchedulerOutput(step_id=1, new_requests=[r], num_scheduled_tokens=[4])


def test_the_step_boundary_checks_the_adapter_fields() -> None:
    batch = InputBatch(4, 64, 16, seed=0)
    good = pb.LoRARequest(lora_name="a", lora_int_id=3, lora_path="/x")
    validate_step(_step(good, 1), batch, 8, 100, max_loras=2)
    validate_step(_step(None), batch, 8, 100)  # base requests need nothing
    for so, max_loras, field in [
            (_step(good), 0, "lora_request"), (_step(good, 2), 2, "lora_slot"), (_step(good, -1), 2, "lora_slot"),
            (_step(pb.LoRARequest(lora_name="a", lora_int_id=0, lora_path="/x")), 2, "lora_int_id"),
            (_step(pb.LoRARequest(lora_name="a", lora_int_id=1)), 2, "lora_path")]:
        with pytest.raises(InvalidStep, match=field):
            validate_step(so, batch, 8, 100, max_loras=max_loras)


def _adapter(lora_id: int, rank: int, modules: tuple[str, ...], seed: int) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    weights = {(layer, m): (torch.randn(rank, SHAPES[m].in_features, generator=gen),
                            torch.randn(SHAPES[m].out_features, rank, generator=gen))
               for layer in range(LAYERS) for m in modules}
    return LoraAdapter(lora_id, rank, weights)


def _reference(y: torch.Tensor, x: torch.Tensor, group: str, layer: int, token_slots: np.ndarray,
               adapters: dict[int, LoraAdapter]) -> torch.Tensor:
    out = y.double().clone()
    start = 0
    for module in GROUPS[group]:
        width = SHAPES[module].out_features
        for t, slot in enumerate(token_slots):
            if slot >= 0 and (layer, module) in adapters[slot].weights:
                a, b = adapters[slot].weights[(layer, module)]
                out[t, start:start + width] += b.double() @ (a.double() @ x[t].double())
        start += width
    return out


@pytest.mark.parametrize("rows", [BGMV_MAX_ROWS - 1, 40, PACKED_GEMM_MAX_ROWS + 3])  # each CPU path
def test_each_token_gets_its_own_slots_products(rows: int) -> None:
    slots = LoraSlots(LAYERS, SLOTS, MAX_RANK, SHAPES, torch.float32, torch.device("cpu"))
    adapters = {0: _adapter(7, 8, tuple(SHAPES), 0), 2: _adapter(9, 3, ("q_proj", "v_proj", "down_proj"), 1)}
    slots.load(1, adapters[0])
    slots.load(1, adapters[2])  # the slot refilled: nothing of the first adapter may remain
    adapters[1] = adapters.pop(2)
    slots.load(0, adapters[0])
    assert slots.held[:2] == [7, 9]
    token_slots = np.array([(t % 3) - 1 for t in range(rows)], dtype=np.int32)  # -1 (base), 0, 1 in turn
    batch = slots.batch(token_slots)
    gen = torch.Generator().manual_seed(rows)
    for group, modules in GROUPS.items():
        width_in = SHAPES[modules[0]].in_features
        width_out = sum(SHAPES[m].out_features for m in modules)
        x, y = torch.randn(rows, width_in, generator=gen), torch.randn(rows, width_out, generator=gen)
        for layer in range(LAYERS):
            got = slots.layer(layer).add(group, y.clone(), x, batch)
            expected = _reference(y, x, group, layer, token_slots, adapters)
            assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-4), (group, layer)
            assert torch.equal(got[token_slots < 0], y[token_slots < 0])  # base tokens untouched


def test_a_step_without_adapters_has_no_lora_batch() -> None:
    assert LoraBatch.from_token_slots(np.array([-1, -1]), 2, 4, torch.float32, torch.device("cpu")) is None
    batch = LoraBatch.from_token_slots(np.array([1, -1]), 2, 2, torch.float32, torch.device("cpu"))
    assert batch.slot_mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 0]]
    assert batch.mask(2).tolist()[0] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_turning_lora_on_reloads_the_weights() -> None:
    """The slot table is built with the model: a LoadModel enabling LoRA (or resizing it) on a
    preloaded worker must rebuild it, while LoRA's defaults without enable_lora change nothing."""
    from services.worker.worker import weights_key

    def load(**lora) -> pb.LoadModelRequest:
        return pb.LoadModelRequest(config=pb.VllmConfig(lora_config=pb.LoRAConfig(**lora)))

    assert weights_key(load(max_loras=1)) == weights_key(load(max_loras=3)) == weights_key(pb.LoadModelRequest())
    assert weights_key(load(enable_lora=True, max_loras=1)) != weights_key(load(max_loras=1))
    assert weights_key(load(enable_lora=True, max_loras=1)) != weights_key(load(enable_lora=True, max_loras=2))
