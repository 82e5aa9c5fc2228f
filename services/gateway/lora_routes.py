"""vLLM's runtime LoRA endpoints: POST /v1/load_lora_adapter and /v1/unload_lora_adapter, added
only with VLLM_ALLOW_RUNTIME_LORA_UPDATING set (else they are unknown routes), behind the API key
like every /v1 route. An adapter is checked against the engine's --max-lora-rank when loaded."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from services.gateway.context import GatewayContext
from services.gateway.errors import invalid_request, unavailable


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


def add_lora_routes(app: FastAPI, context_of: Callable[[Request], GatewayContext]) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
        ctx = context_of(request)
        stats = await ctx.router.stats()
        if stats is None:
            raise unavailable("No engine replica answered: the adapter cannot be checked against it",
                              "scheduler_unavailable")
        if stats.max_lora == 0:
            raise invalid_request("the engine serves no LoRA adapters (start it with --enable-lora)",
                                  param="lora_name")
        ctx.lora.add_at_runtime(body.lora_name, body.lora_path, stats.max_lora_rank)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
        context_of(request).lora.remove(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
