"""OLMoE: an RMSNorm over the whole q and the whole k projection (not per head), optional
q/k/v clipping (`clip_qkv`), routed experts in every layer, top-k weights renormalised only
with `norm_topk_prob`; `intermediate_size` is each expert's width."""

from services.worker.models.layers import DecoderForCausalLM, DecoderSpec
from services.worker.models.moe import MoeSpec


class OlmoeForCausalLM(DecoderForCausalLM):
    spec = DecoderSpec(full_qk_norm=True, moe=MoeSpec(intermediate_attr="intermediate_size"))
