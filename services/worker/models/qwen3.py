"""Qwen3: no q/k/v biases, but an RMSNorm over each head of q and k before RoPE."""

from services.worker.models.layers import DecoderForCausalLM, DecoderSpec


class Qwen3ForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec(qk_norm=True)
