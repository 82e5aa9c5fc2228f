"""Request and response bodies of OpenAI's embeddings API (`POST /v1/embeddings`), plus vLLM's
extensions that change nothing here being left out: an unknown field is a 400 naming it, as on
every other route (protocol.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from services.gateway.protocol import Int32, OpenAIBaseModel

# OpenAI's four input shapes: one string, strings, one token-id list, token-id lists.
EmbeddingInput = str | list[str] | list[Int32] | list[list[Int32]]


class EmbeddingRequest(OpenAIBaseModel):
    input: EmbeddingInput
    model: str | None = None
    # "float": a JSON list; "base64": the little-endian float32 bytes, base64 (the openai client's default).
    encoding_format: Literal["float", "base64"] = "float"
    # Matryoshka truncation: only for a model whose config allows it (refused with a 400 otherwise).
    dimensions: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    user: str | None = None  # OpenAI's: accepted, ignored
    add_special_tokens: bool = True  # vLLM's extension: how string inputs are tokenized


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
