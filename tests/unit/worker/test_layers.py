"""Layer building blocks against HF transformers' own modules (bitwise where the math is the same)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from services.worker.models.layers import RMSNorm, RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (37, 576), (5, 9, 64)])
def test_rms_norm_is_hf_bitwise(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    ours, theirs = RMSNorm(shape[-1], 1e-5), LlamaRMSNorm(shape[-1], eps=1e-5)
    with torch.no_grad():
        weight = torch.randn(shape[-1], generator=gen).to(dtype)
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
        ours, theirs = ours.to(dtype), theirs.to(dtype)
        assert torch.equal(ours(x), theirs(x))


def test_rope_on_q_and_k_together_is_hf_bitwise() -> None:
    head_dim, num_heads, num_kv_heads, T = 64, 9, 3, 11
    rope = RotaryEmbedding(head_dim, 256, 100000.0, None)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(T, num_heads, head_dim, generator=gen)
    k = torch.randn(T, num_kv_heads, head_dim, generator=gen)
    positions = torch.tensor([0, 1, 2, 3, 4, 100, 101, 7, 8, 255, 3])
    cos_sin = rope.lookup(positions, torch.float32)
    rotated = rope(cos_sin, torch.cat((q, k), dim=1))
    cos, sin = rope.cos[positions], rope.sin[positions]
    # HF layout: [batch, heads, T, D] with cos/sin [batch, T, D]
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(rotated[:, :num_heads], q_ref[0].transpose(0, 1))
    assert torch.equal(rotated[:, num_heads:], k_ref[0].transpose(0, 1))
