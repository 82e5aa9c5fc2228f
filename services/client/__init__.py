"""The gRPC SDK: `Client` / `AsyncClient` talk to a scheduler's `Generate` stream (the gateway's
own route to the engines). Light on purpose: it loads neither torch nor the engine."""

from __future__ import annotations

from services.client.grpc_client import AsyncClient, Client, RequestRejected, SchedulerAuthError, SchedulerUnavailable
from services.common.sampling_params import SamplingParams
from services.common.structured_outputs import StructuredOutputsParams

__all__ = ["AsyncClient", "Client", "RequestRejected", "SchedulerAuthError", "SchedulerUnavailable", "SamplingParams",
           "StructuredOutputsParams"]
