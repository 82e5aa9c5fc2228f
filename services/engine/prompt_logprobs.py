"""The scheduler's part of prompt logprobs: each step's chunks filed by prompt position."""

from __future__ import annotations

from collections.abc import Iterable

from services.common.proto import myvllm_pb2 as pb
from services.engine.request import Request


def gather_prompt_logprobs(chunks: Iterable[pb.PromptLogprobs], requests: dict[str, Request]) -> None:
    """File each step's prompt logprobs by position (a preempted request recomputes its
    prompt and simply overwrites the same positions)."""
    for chunk in chunks:
        request = requests.get(chunk.request_id)
        if request is None or not request.needs_prompt_logprobs:
            continue
        start = chunk.first_position - 1
        request.prompt_logprobs[start:start + len(chunk.logprobs)] = list(chunk.logprobs)
