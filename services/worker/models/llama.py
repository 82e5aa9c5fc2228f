"""Llama (and SmolLM2, which is a Llama): RMSNorm, RoPE, GQA, SwiGLU, no biases."""

from services.worker.models.layers import DecoderForCausalLM, DecoderSpec


class LlamaForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec()
