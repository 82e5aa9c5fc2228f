"""The scheduler's running totals that the gateway's /metrics and its periodic stats line read."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from services.engine.request import Request


@dataclasses.dataclass
class EngineCounters:
    num_preemptions: int = 0
    # Counted as vLLM's stats line counts them: a request's whole prompt once its first token is
    # out, and every token generated.
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # CUDA graph captures that failed in automatic mode (the worker reports each once).
    cudagraph_capture_failures: int = 0

    def count_output(self, request: Request, new_token_ids: Sequence[int]) -> None:
        """Count the tokens a step appended to `request` (already in its output)."""
        self.generation_tokens += len(new_token_ids)
        if new_token_ids and request.num_output_tokens == len(new_token_ids):  # its first tokens
            self.prompt_tokens += request.num_prompt_tokens

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)
