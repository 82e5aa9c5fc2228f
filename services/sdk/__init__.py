"""Client-side entry points: the in-process offline `LLM` and the gRPC `Client` / `AsyncClient`."""

from services.common.sampling_params import SamplingParams
from services.common.structured_outputs import StructuredOutputsParams
from services.sdk.client import AsyncClient, Client, RequestRejected, SchedulerUnavailable
from services.sdk.llm import LLM, EngineFault
from services.sdk.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "AsyncClient", "Client", "RequestRejected", "SchedulerUnavailable", "EngineFault"]
