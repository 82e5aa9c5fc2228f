"""Qwen2-MoE: Qwen2's attention (q/k/v biases, no q/k norm) with routed experts in the layers
that `decoder_sparse_step` / `mlp_only_layers` pick (a dense MLP of `intermediate_size`
elsewhere), top-k weights renormalised only with `norm_topk_prob`, and in each MoE layer a
shared expert: a dense MLP of `shared_expert_intermediate_size` gated by
sigmoid(`shared_expert_gate`(x)), added to the routed experts' sum."""

from services.worker.models.layers import DecoderForCausalLM, DecoderSpec
from services.worker.models.moe import MoeSpec


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec(qkv_bias=True, moe=MoeSpec(shared_expert=True))
