"""Building blocks shared by the decoder-only architectures (Llama, Qwen2, Qwen3, and the
mixture-of-experts Qwen2-MoE, Qwen3-MoE, Mixtral and OLMoE, whose MLP is a `moe.SparseMoeBlock`).

Projections are fused where HF keeps them apart (q/k/v into one `qkv_proj`, gate/up into
one `gate_up_proj`): one matmul instead of three or two per layer; models/loader.py maps HF
checkpoint names onto the fused parameters. Under tensor parallelism each rank builds and
loads only its shard (services/worker/parallel.py says how things split); with one rank the
arithmetic is exactly the unsharded model's. What runs the layers faster than their torch ops
(fused kernels, C steps, packed weights) is chosen by models/fast_paths.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention.base import AttentionLayer, current_metadata
from services.worker.lora.apply import LoraBatch
from services.worker.lora.slots import LayerLora
from services.worker.models.c_step.decode_step import CpuDecodeStep, PackedStep
from services.worker.models.fast_paths import c_step_for
from services.worker.models.layer_ops import TORCH_OPS, FusedCpuOps, LayerOps, TritonOps
from services.worker.models.moe import MoeSpec, SparseMoeBlock
from services.worker.parallel import (
    all_gather_last_dim,
    all_reduce,
    column_range,
    get_pp,
    get_tp,
    head_range,
    kv_head_range,
    stage_layers,
    vocab_range,
)
from services.worker.quant.ops import quant_matmul
from services.worker.quant.weights import QuantWeights


@dataclass
class DecoderSpec:
    """What distinguishes one architecture's decoder layer from another's."""

    qkv_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each q and k head (Qwen3)
    full_qk_norm: bool = False  # an RMSNorm over the whole q and the whole k projection (OLMoE)
    mlp_bias: bool = False
    moe: MoeSpec | None = None  # the MLP of some or all layers is made of routed experts


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused op; in fp32 it is bitwise HF's arithmetic (tests/unit/worker/test_layers.py).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Same arithmetic as HF: normalise in fp32, cast back, then scale.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RowParallelLinear(nn.Linear):
    """A linear layer whose input columns are split across TP ranks: each rank's partial
    product is summed by one all-reduce, then the (replicated) bias is added once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if get_tp().size == 1:
            return super().forward(x)
        y = all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Each TP rank holds the rows of one vocabulary range; ids outside it contribute zeros
    and one all-reduce assembles every token's row."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        self.vocab_start, rows = vocab_range(vocab_size, get_tp())
        super().__init__(rows, hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if get_tp().size == 1:
            return super().forward(ids)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(torch.where(inside, local, 0), self.weight)
        return all_reduce(rows * inside.unsqueeze(-1).to(rows.dtype))


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE with a cos/sin table indexed by each token's position."""

    def __init__(self, head_dim: int, max_position: int, theta: float, rope_scaling: dict | None) -> None:
        super().__init__()
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(f"rope scaling type {rope_type!r} is not supported")
        self.head_dim, self.max_position, self.theta = head_dim, max_position, theta
        self.half = head_dim // 2
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_tables()

    def reset_tables(self, device: torch.device | str = "cpu") -> None:
        """(Re)build the fp32 cos/sin tables, e.g. after the model was made on `meta`."""
        with torch.device(device):
            exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
            inv_freq = 1.0 / (self.theta ** exponent)
            freqs = torch.arange(self.max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos, self.sin = emb.cos(), emb.sin()

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for this step's positions, [T, 1, D]: computed once, shared by all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Rotate x: [T, heads, D] (q and k heads together: one set of ops for both)."""
        cos, sin = cos_sin
        return x * cos + self._rotate_half(x) * sin

    def _rotate_half(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., self.half:], x[..., :self.half]), dim=-1)


class SelfAttention(nn.Module):
    def __init__(self, config, layer_idx: int, spec: DecoderSpec) -> None:
        super().__init__()
        tp = get_tp()
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # This rank's heads (all of them with one rank): the first one's index and how many.
        self.head_start, self.num_heads = head_range(config.num_attention_heads, tp)
        self.kv_head_start, self.num_kv_heads = kv_head_range(config.num_key_value_heads, tp)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Qwen2-MoE's config says whether q/k/v carry biases (`qkv_bias`); the others' architecture does.
        bias = getattr(config, "qkv_bias", spec.qkv_bias) or getattr(config, "attention_bias", False)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, bias=getattr(config, "attention_bias", False))
        self.full_qk_norm = spec.full_qk_norm
        q_norm_size, k_norm_size = (self.q_size, self.kv_size) if spec.full_qk_norm else (self.head_dim,) * 2
        qk_norm = spec.qk_norm or spec.full_qk_norm
        self.q_norm = RMSNorm(q_norm_size, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(k_norm_size, config.rms_norm_eps) if qk_norm else None
        self.clip_qkv = getattr(config, "clip_qkv", None)
        self.attn = AttentionLayer(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim)
        # This layer's LoRA slots (set by the runner under --enable-lora).
        self.lora: LayerLora | None = None

    def forward(self, ops: LayerOps, rope_state: object, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        lora = _step_lora(self.lora)
        if lora is not None:
            qkv = self.lora.add("qkv", qkv, x, lora)
        heads = self.num_heads + self.num_kv_heads
        qk = qkv  # q and k: its first q_size + kv_size columns (a backend may rotate them in place)
        if self.full_qk_norm:
            qk = torch.cat((_full_width_norm(qkv[:, :self.q_size], self.q_norm),
                            _full_width_norm(qkv[:, self.q_size:self.q_size + self.kv_size], self.k_norm)), dim=1)
        elif self.q_norm is not None:
            qk = qkv[:, :self.q_size + self.kv_size].unflatten(-1, (heads, self.head_dim))
            qk = torch.cat((self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])), dim=1)
            qk = qk.flatten(1)
        v = qkv[:, self.q_size + self.kv_size:]
        if self.clip_qkv is not None:  # OLMoE: after the norms, before RoPE
            qk = qk[:, :self.q_size + self.kv_size].clamp(-self.clip_qkv, self.clip_qkv)
            v = v.clamp(-self.clip_qkv, self.clip_qkv)
        q, k = ops.rope(qk, heads, self.head_dim, rope_state).split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        out = self.attn(q, k, v).reshape(-1, self.q_size)
        if lora is not None:
            return self.lora.add("o", self.o_proj(out), out, lora)
        return self.o_proj(out)


def _step_lora(layer_lora: LayerLora | None) -> LoraBatch | None:
    """The step's adapter slots per token, where this layer has LoRA slots and the step uses them."""
    if layer_lora is None:
        return None
    meta = current_metadata()
    return None if meta is None else meta.lora


def _full_width_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """RMSNorm over a whole projection (all heads). Under tensor parallelism each rank holds some
    heads: the sum of squares is all-reduced. With KV heads replicated over r ranks the sum
    counts each head r times and the ranks' widths add up to r times the width, so dividing by
    tp_size * local width is right in both cases."""
    tp_size = get_tp().size
    if tp_size == 1:
        return norm(x)
    x32 = x.float()
    variance = all_reduce(x32.pow(2).sum(-1, keepdim=True)) / (x.shape[-1] * tp_size)
    return norm.weight * (x32 * torch.rsqrt(variance + norm.eps)).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, config, spec: DecoderSpec) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"activation {config.hidden_act!r} is not supported")
        # This rank's slice of the intermediate columns (all of them with one rank).
        self.intermediate_start, self.intermediate_size = column_range(config.intermediate_size, get_tp())
        bias = spec.mlp_bias or getattr(config, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = RowParallelLinear(self.intermediate_size, config.hidden_size, bias=bias)
        self.lora: LayerLora | None = None  # set by the runner under --enable-lora

    def forward(self, ops: LayerOps, x: torch.Tensor) -> torch.Tensor:
        lora = _step_lora(self.lora)
        if lora is None:
            return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        h = ops.silu_and_mul(self.lora.add("gate_up", self.gate_up_proj(x), x, lora))
        return self.lora.add("down", self.down_proj(h), h, lora)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, spec: DecoderSpec) -> None:
        super().__init__()
        self.self_attn = SelfAttention(config, layer_idx, spec)
        moe = spec.moe is not None and spec.moe.is_moe_layer(config, layer_idx)
        self.mlp = SparseMoeBlock(config, spec.moe) if moe else MLP(config, spec)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, ops: LayerOps, rope_state: object, h: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's residual form: `h` is the previous layer's MLP output (the embedding, with
        `residual` None, for the first layer); returns this layer's MLP output and the residual
        stream before it. The adds are HF's, in the same order."""
        if residual is None:
            residual, h = h, ops.rms_norm(h, self.input_layernorm)
        else:
            h, residual = ops.add_rms_norm(h, residual, self.input_layernorm)
        h = self.self_attn(ops, rope_state, h)
        h, residual = ops.add_rms_norm(h, residual, self.post_attention_layernorm)
        return self.mlp(ops, h), residual


class DecoderForCausalLM(nn.Module):
    """A decoder-only LM over a flat ragged batch of tokens: [T] ids → [T, hidden].

    Under pipeline parallelism this rank builds only its stage: its run of layers (the others
    are empty placeholders, so checkpoint names keep their indices), the embedding on the first
    stage, the final norm and LM head on the last (which also keeps the embedding table when
    the LM head is tied to it)."""

    spec = DecoderSpec()

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        pp = get_pp()
        self.is_first_stage, self.is_last_stage = pp.is_first, pp.is_last
        self.layer_range = stage_layers(config.num_hidden_layers, pp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens: VocabParallelEmbedding | None = None
        if self.is_first_stage or (self.is_last_stage and self.tie_word_embeddings):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, self.spec) if i in self.layer_range else nn.Identity()
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last_stage else None
        if self.is_last_stage and not self.tie_word_embeddings:
            # Same vocabulary rows as the embedding shard.
            self.lm_head = nn.Linear(config.hidden_size, vocab_range(config.vocab_size, get_tp())[1], bias=False)
        first = self.layers[self.layer_range.start].self_attn
        rope_theta = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get(
            "rope_theta", 10000.0)
        self.rotary_emb = RotaryEmbedding(first.head_dim, config.max_position_embeddings, float(rope_theta),
                                          _plain_rope_scaling(config))
        # What runs faster than the layers' torch ops, set by models/fast_paths.py. The LM head
        # over the tied embedding table, when `pack_for_cpu` gave it a packed copy.
        self.tied_head: nn.Module | None = None
        # The fused elementwise ops (C on CPU, Triton on CUDA), when `use_fused_ops` enabled them
        # (else torch's).
        self.fused_ops: FusedCpuOps | TritonOps | None = None
        # Small decode steps as one C call, when `use_cpu_decode_step` enabled it; other steps,
        # when `use_cpu_packed_step` did.
        self.decode_step: CpuDecodeStep | None = None
        self.packed_step: PackedStep | None = None

    def is_quantized(self) -> bool:
        """Whether any of its weights are kept in quantized blocks (services/worker/quant)."""
        return any(isinstance(m, QuantWeights) for m in self.modules())

    def _stage(self) -> Iterable[DecoderLayer]:
        return self.layers[self.layer_range.start:self.layer_range.stop]

    def attention_layers(self) -> list[AttentionLayer]:
        return [layer.self_attn.attn for layer in self._stage()]

    def moe_blocks(self) -> list[SparseMoeBlock]:
        """This stage's MoE layers' blocks, in layer order."""
        return [layer.mlp for layer in self._stage() if isinstance(layer.mlp, SparseMoeBlock)]

    def dummy_step(self) -> None:
        """A step in which this engine has no tokens, while data-parallel engines of its
        expert-parallel group have: every MoE layer's exchange, in the order a forward runs them."""
        for block in self.moe_blocks():
            block.dummy_step()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The first stage embeds `input_ids`; later stages continue from the previous stage's
        `hidden`. The last stage returns normed hidden states, the others the raw residual stream."""
        x = self.embed_tokens(input_ids) if self.is_first_stage else hidden
        if (self.decode_step is not None or self.packed_step is not None) and not torch.compiler.is_compiling():
            meta = current_metadata()
            step = c_step_for(self, meta) if meta is not None else None
            if step is not None:
                return step.forward(x, positions, meta)
        # torch.compile traces the torch ops (it fuses them itself).
        ops = self.fused_ops if self.fused_ops is not None and not torch.compiler.is_compiling() else TORCH_OPS
        rope_state = ops.rope_state(self.rotary_emb, positions, x.dtype)
        # An in-place backend writes the residual stream: never into a tensor we were handed.
        h, residual = (x.clone() if ops.in_place and not self.is_first_stage else x), None
        for layer in self._stage():
            h, residual = layer(ops, rope_state, h, residual)
        if residual is None:  # a stage without layers
            return self.norm(h) if self.is_last_stage else h
        if self.is_last_stage:
            return ops.add_rms_norm(h, residual, self.norm)[0]
        return residual + h  # the residual stream, which the next stage continues

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.decode_step is not None and 0 < hidden.shape[0] <= self.decode_step.max_rows \
                and not torch.compiler.is_compiling():
            logits = self.decode_step.lm_head(hidden)
        elif self.tied_head is not None:
            logits = self.tied_head(hidden)
        elif self.tie_word_embeddings and isinstance(self.embed_tokens, QuantWeights):
            logits = quant_matmul(hidden, self.embed_tokens)  # the embedding's own blocks
        elif self.tie_word_embeddings:
            logits = F.linear(hidden, self.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        # Under tensor parallelism each rank computed its vocabulary shard's columns.
        return all_gather_last_dim(logits)[..., :self.config.vocab_size].float()


def _plain_rope_scaling(config) -> dict | None:
    scaling = getattr(config, "rope_scaling", None)
    if scaling is None:
        params = getattr(config, "rope_parameters", None)
        if isinstance(params, dict) and params.get("rope_type", "default") != "default":
            scaling = params
    return scaling
