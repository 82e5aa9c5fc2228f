"""The MoE routing and grouping path issues no op that synchronises with the host on CUDA, so an
MoE decode step can be captured in a CUDA graph. The path runs on CPU tensors under a
TorchDispatchMode that records every aten op; none may be in the host-syncing list (ops that
read a value back, size an output by the data, or copy host data in)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from services.worker.models import fused_moe_triton
from services.worker.models.moe import route

# aten ops that wait for the device (a scalar read back, an output sized by the data) or copy a
# host value in during the step.
HOST_SYNCING = {
    "aten._local_scalar_dense",  # .item(), int(t), bool(t)
    "aten.nonzero", "aten.nonzero_static_fallback", "aten.bincount", "aten.masked_select",
    "aten.unique", "aten._unique", "aten._unique2", "aten.unique_consecutive", "aten.unique_dim",
    "aten.lift_fresh",  # torch.tensor / new_tensor from Python values
}


class OpRecorder(TorchDispatchMode):
    """Every aten op dispatched inside the block, with repeat_interleave calls lacking output_size
    flagged (their output length is read back from the device)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name == "aten.repeat_interleave" and kwargs.get("output_size") is None:
            name = "aten.repeat_interleave(no output_size)"
        self.ops.append(name)
        return func(*args, **kwargs)


def syncing(ops: list[str]) -> list[str]:
    return sorted({op for op in ops if op in HOST_SYNCING or op.endswith("(no output_size)")})


@pytest.fixture
def no_tolist(monkeypatch: pytest.MonkeyPatch) -> None:
    """.tolist() and .numpy() bypass the dispatcher: make them fail loudly instead."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("a host read-back (.tolist()/.numpy()) on the MoE path")
    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    monkeypatch.setattr(torch.Tensor, "numpy", refuse)


def test_the_recorder_sees_the_syncing_ops() -> None:
    """The check is live: each known host sync is caught."""
    x = torch.tensor([1, 2, 2])
    with OpRecorder() as rec:
        x.sum().item()
        torch.bincount(x)
        x.nonzero()
        torch.unique(x)
        x.repeat_interleave(x)
        x.new_tensor([1])
    assert syncing(rec.ops) == sorted({"aten._local_scalar_dense", "aten.bincount", "aten.nonzero",
                                       "aten.lift_fresh", "aten.repeat_interleave(no output_size)"}
                                      | {op for op in rec.ops if op.startswith("aten._unique")})


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "held"), [(1, 8, 2, 8), (13, 6, 3, 6),
                                                                          (7, 8, 2, 3)])
def test_routing_and_grouping_issue_no_host_sync(no_tolist: None, num_tokens: int, num_experts: int, top_k: int,
                                                 held: int) -> None:
    g = torch.Generator().manual_seed(num_tokens)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    down = torch.randn(num_tokens, top_k, 16, generator=g)
    with OpRecorder() as rec:
        weights, ids = route(logits, top_k, True, torch.float32)
        ids = ids - (num_experts - held)  # with fewer experts held, some ids are another rank's
        sorted_pairs, expert_of_tile, num_padded = fused_moe_triton.align_block_size(ids, held)
        out = fused_moe_triton.sum_in_expert_order(down, ids)
    assert rec.ops, "nothing recorded"
    assert syncing(rec.ops) == [], f"host-syncing ops on the MoE path: {syncing(rec.ops)}"
    assert out.shape == (num_tokens, 16) and weights.shape == ids.shape
    # The layout is what the bincount version gave: every held pair once, in its expert's tiles.
    flat = ids.reshape(-1)
    placed = sorted_pairs[sorted_pairs < flat.numel()]
    held_pairs = ((flat >= 0) & (flat < held)).sum()
    assert placed.numel() == int(held_pairs)
    tiles = torch.arange(sorted_pairs.numel()) // fused_moe_triton.BLOCK_M
    real = sorted_pairs < flat.numel()
    assert torch.equal(flat[sorted_pairs[real].long()], expert_of_tile[tiles[real]].long())
    assert int(num_padded[0]) % fused_moe_triton.BLOCK_M == 0


def test_expert_counts_equal_bincount() -> None:
    key = torch.tensor([3, 0, 3, 1, 4, 4, 4])
    assert torch.equal(fused_moe_triton.expert_counts(key, 6), torch.bincount(key, minlength=6))
