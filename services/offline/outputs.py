"""vLLM-shaped result objects of the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: None for the first prompt token (nothing before it),
    # then {token id: Logprob} holding the prompt token and the top-k alternatives.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # P/D disaggregation (vLLM's field): a do_remote_decode request's params for its consumer
    # request (pass them as SamplingParams.extra_args["kv_transfer_params"] there).
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's `EmbeddingRequestOutput`: one prompt's embedding (`outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    prompt: str | None = None
