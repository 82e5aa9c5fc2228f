"""The Triton fused-MoE kernels (services/worker/models/fused_moe_triton.py) against the torch
grouped path, on random routings: every expert with and without tokens, ids of experts another
rank holds, a single token. Without CUDA they run under TRITON_INTERPRET=1 on CPU tensors
(tiny sizes: the interpreter is slow); with CUDA, compiled on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from support.triton_device import DEVICE, fresh_process_only, needs_device, run_in_fresh_interpreter

from services.worker.models import fused_moe_triton
from services.worker.models.moe import grouped_experts


@fresh_process_only
def test_in_fresh_interpreter_process() -> None:
    run_in_fresh_interpreter(__file__, timeout_s=600)


def test_align_block_size_groups_pairs_by_expert_in_padded_tiles() -> None:
    ids = torch.tensor([[2, 0], [0, 5], [2, -1]])  # 3 experts held here: 5 and -1 are another rank's
    sorted_pairs, expert_of_tile, num_padded = fused_moe_triton.align_block_size(ids, 3, block_m=4)
    sentinel = ids.numel()
    # expert 0: pairs 1, 2; expert 1: none; expert 2: pairs 0, 4; each group padded to 4
    assert num_padded.tolist() == [8]
    assert sorted_pairs[:8].tolist() == [1, 2, sentinel, sentinel, 0, 4, sentinel, sentinel]
    assert (sorted_pairs[8:] == sentinel).all() and len(sorted_pairs) % 4 == 0
    assert expert_of_tile[:2].tolist() == [0, 2]


@needs_device
@pytest.mark.parametrize(("num_tokens", "top_k", "dtype"), [(1, 2, torch.float32), (19, 2, torch.float32),
                                                            (9, 3, torch.bfloat16)])
def test_triton_experts_match_the_torch_path(num_tokens: int, top_k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(num_tokens)
    experts, hidden, width = 5, 48, 40  # widths that are not multiples of the tiles
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * width, hidden, generator=g) / 6).to(dtype)
    w2 = (torch.randn(experts, hidden, width, generator=g) / 6).to(dtype)
    ids = torch.stack([torch.randperm(experts + 1, generator=g)[:top_k] for _ in range(num_tokens)])  # id 5: not held
    weights = torch.rand(num_tokens, top_k, generator=g).to(dtype)
    want = grouped_experts(x.float(), w13.float(), w2.float(), weights.float(), ids)
    got = fused_moe_triton.fused_experts(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids))).cpu()
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance)
