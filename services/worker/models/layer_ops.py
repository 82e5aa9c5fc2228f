"""The decoder layers' elementwise ops, one interface with three backends.

A layer has one forward (models/layers.py, vLLM's residual form: each norm also adds the
residual stream); what runs its norms, RoPE and SiLU·mul is a backend chosen per model:
- `TorchOps`: plain torch, HF's arithmetic; any device and dtype, and what torch.compile traces;
- `FusedCpuOps`: one C pass per op (services/worker/cpu/cpu_ops.c), CPU fp32/bf16, in place
  where it can (the residual add and RoPE write into tensors the layer owns);
- `TritonOps`: one Triton kernel per op (models/triton_ops.py), CUDA fp32/bf16/fp16, in place
  like `FusedCpuOps` (vLLM's fused_add_rms_norm, rotary_embedding and silu_and_mul forms).
`fast_paths.use_fused_ops` picks the backend for the model's device; torch.compile
always traces `TorchOps`. All three compute the same adds in the same order as HF's layer
(x + attn(norm(x)), then x + mlp(norm(x))), so the backend changes speed, not which token
comes out.
"""

from __future__ import annotations

from typing import Protocol

import torch

from services.worker.cpu.cpu_ops import CpuOps


class Norm(Protocol):
    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Rope(Protocol):
    cos: torch.Tensor
    sin: torch.Tensor

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]: ...

    def __call__(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor: ...


class TorchOps:
    """The ops in torch: new tensors, nothing written in place."""

    in_place = False

    def rope_state(self, rope: Rope, positions: torch.Tensor, dtype: torch.dtype) -> object:
        """What every layer's RoPE of this forward needs, computed once: the cos/sin rows."""
        return rope, rope.lookup(positions, dtype)

    def rms_norm(self, x: torch.Tensor, norm: Norm) -> torch.Tensor:
        return norm(x)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: Norm) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x)."""
        residual = residual + x
        return norm(residual), residual

    def rope(self, qk: torch.Tensor, num_heads: int, head_dim: int, state: object) -> torch.Tensor:
        """The first `num_heads` heads of each row of qk ([T, >= num_heads * head_dim]) rotated:
        [T, num_heads, head_dim]."""
        rope, cos_sin = state
        return rope(cos_sin, qk[:, :num_heads * head_dim].unflatten(-1, (num_heads, head_dim)))

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


class FusedCpuOps:
    """The ops through cpu_ops.c: the residual add and RoPE in place."""

    in_place = True

    def __init__(self, ops: CpuOps) -> None:
        self.ops = ops

    def rope_state(self, rope: Rope, positions: torch.Tensor, dtype: torch.dtype) -> object:
        return rope, positions.to(torch.int64).contiguous()

    def rms_norm(self, x: torch.Tensor, norm: Norm) -> torch.Tensor:
        return self.ops.rms_norm(x, norm.weight, norm.eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: Norm) -> tuple[torch.Tensor, torch.Tensor]:
        self.ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)  # residual += x; x = norm(residual)
        return x, residual

    def rope(self, qk: torch.Tensor, num_heads: int, head_dim: int, state: object) -> torch.Tensor:
        rope, positions = state
        self.ops.rope_neox_(qk, num_heads, head_dim, positions, rope.cos, rope.sin)
        return qk[:, :num_heads * head_dim].unflatten(-1, (num_heads, head_dim))

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(gate_up)


class TritonOps:
    """The ops as Triton kernels (models/triton_ops.py): the residual add and RoPE in place.
    Rounds where `TorchOps` does; imports triton only when made."""

    in_place = True
    DTYPES = (torch.float32, torch.bfloat16, torch.float16)

    def __init__(self) -> None:
        from services.worker.models import triton_ops

        self.kernels = triton_ops

    @classmethod
    def supports(cls, param: torch.Tensor) -> bool:
        """CUDA tensors of a dtype the kernels take, with triton installed."""
        if param.device.type != "cuda" or param.dtype not in cls.DTYPES:
            return False
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True

    def rope_state(self, rope: Rope, positions: torch.Tensor, dtype: torch.dtype) -> object:
        return rope, positions.contiguous()

    def rms_norm(self, x: torch.Tensor, norm: Norm) -> torch.Tensor:
        return self.kernels.rms_norm(x, norm.weight, norm.eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: Norm) -> tuple[torch.Tensor, torch.Tensor]:
        self.kernels.fused_add_rms_norm(x, residual, norm.weight, norm.eps)  # residual += x; x = norm(residual)
        return x, residual

    def rope(self, qk: torch.Tensor, num_heads: int, head_dim: int, state: object) -> torch.Tensor:
        rope, positions = state
        # RotaryEmbedding is neox style over the whole head (no GPT-J or partial rotary models here).
        self.kernels.rope_(qk, positions, rope.cos, rope.sin, num_heads, head_dim, is_neox=True)
        return qk[:, :num_heads * head_dim].unflatten(-1, (num_heads, head_dim))

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(gate_up)


TORCH_OPS = TorchOps()
LayerOps = TorchOps | FusedCpuOps | TritonOps
