"""Model registry: HF `architectures` name → our class. A new model is one new file here."""

from services.worker.models.llama import LlamaForCausalLM
from services.worker.models.mixtral import MixtralForCausalLM
from services.worker.models.olmoe import OlmoeForCausalLM
from services.worker.models.qwen2 import Qwen2ForCausalLM
from services.worker.models.qwen2_moe import Qwen2MoeForCausalLM
from services.worker.models.qwen3 import Qwen3ForCausalLM
from services.worker.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}

# For config.json files that name only `model_type` (e.g. converted from GGUF).
MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM",
                      "qwen2": "Qwen2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "qwen3_moe": "Qwen3MoeForCausalLM"}

__all__ = ["MODEL_REGISTRY", "MODEL_TYPE_TO_ARCH", "LlamaForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM",
           "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]
