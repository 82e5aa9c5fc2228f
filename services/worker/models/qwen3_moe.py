"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with routed experts in the layers that
`decoder_sparse_step` / `mlp_only_layers` pick; top-k weights renormalised when
`norm_topk_prob`."""

from services.worker.models.layers import DecoderForCausalLM, DecoderSpec
from services.worker.models.moe import MoeSpec


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec(qk_norm=True, moe=MoeSpec())
