"""Mixtral: Llama's attention with routed experts in every layer (`block_sparse_moe`, experts'
w1/w3/w2 = gate/up/down); the top-k weights are always renormalised and stay fp32."""

from services.worker.models.layers import DecoderForCausalLM, DecoderSpec
from services.worker.models.moe import MoeSpec

MIXTRAL_MOE = MoeSpec(num_experts_attr="num_local_experts", intermediate_attr="intermediate_size",
                      renormalize=True, fp32_weights=True, checkpoint_module="block_sparse_moe",
                      expert_names=("w1", "w3", "w2"))


class MixtralForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec(moe=MIXTRAL_MOE)

    def __init__(self, config) -> None:
        if getattr(config, "sliding_window", None) is not None \
                and config.sliding_window < config.max_position_embeddings:
            raise NotImplementedError(f"sliding-window attention (sliding_window={config.sliding_window}) "
                                      "is not supported")
        super().__init__(config)
