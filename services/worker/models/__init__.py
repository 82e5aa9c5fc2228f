"""Model registry: HF `architectures` name → our class. A new model is one new file here."""

from services.worker.models.llama import LlamaForCausalLM
from services.worker.models.qwen2 import Qwen2ForCausalLM
from services.worker.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

# For config.json files that name only `model_type` (e.g. converted from GGUF).
MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

__all__ = ["MODEL_REGISTRY", "MODEL_TYPE_TO_ARCH", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
