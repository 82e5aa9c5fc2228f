"""Qwen2: a Llama-shaped decoder whose q/k/v projections carry biases."""

from services.worker.models.layers import DecoderForCausalLM, DecoderSpec


class Qwen2ForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec(qkv_bias=True)
