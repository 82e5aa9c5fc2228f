"""Client-side entry points: the in-process offline `LLM` and the gRPC `Client` / `AsyncClient`.

`LLM` (torch, transformers, the worker) is imported on first use, so that `services.sdk.client`,
which the gateway imports, does not load the engine: `myvllm serve` and the gateway start
seconds sooner.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from services.common.pooling_config import PoolingParams
from services.common.sampling_params import SamplingParams
from services.common.structured_outputs import StructuredOutputsParams
from services.sdk.client import AsyncClient, Client, RequestRejected, SchedulerUnavailable
from services.sdk.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput

if TYPE_CHECKING:
    from services.sdk.llm import LLM, EngineFault

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "PoolingParams", "EmbeddingOutput", "EmbeddingRequestOutput",
           "AsyncClient", "Client", "RequestRejected", "SchedulerUnavailable", "EngineFault"]
_LAZY = {"LLM": "services.sdk.llm", "EngineFault": "services.sdk.llm"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
