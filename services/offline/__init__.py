"""The offline engine, vLLM's `LLM`: the same engine as `serve` (services/engine) over worker
ranks in this process and its children, with vLLM's output types."""

from __future__ import annotations

from services.common.lora_request import LoRARequest
from services.common.pooling_config import PoolingParams
from services.common.sampling_params import SamplingParams
from services.common.structured_outputs import StructuredOutputsParams
from services.offline.llm import LLM, EngineFault
from services.offline.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput

__all__ = ["LLM", "EngineFault", "SamplingParams", "StructuredOutputsParams", "PoolingParams", "RequestOutput",
           "CompletionOutput", "Logprob", "EmbeddingOutput", "EmbeddingRequestOutput", "LoRARequest"]
