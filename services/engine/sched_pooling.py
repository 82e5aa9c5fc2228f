"""The scheduler's part of pooling (embedding) requests: a pooler output finishes its request."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from services.common.proto import myvllm_pb2 as pb
from services.engine.request import Request, RequestStatus


def finish_pooled(pooler_output: Iterable[pb.PoolerOutput], requests: dict[str, Request],
                  end: Callable[[Request], None]) -> list[pb.RequestOutput]:
    """Pooling requests whose prompt the step completed: each ends ("stop") with its embedding,
    and `end` takes it out of the batch and frees its blocks (vLLM: a pooler output finishes the
    request)."""
    outputs = []
    for pooled in pooler_output:
        request = requests.get(pooled.request_id)
        if request is None or not request.is_pooling or request.status != RequestStatus.RUNNING \
                or request.num_computed_tokens < request.num_tokens:
            continue  # aborted (or preempted) while the step ran
        outputs.append(pb.RequestOutput(request_id=request.request_id, finish_reason="stop", stop_token_id=-1,
                                        num_prompt_tokens=request.num_prompt_tokens, pooled_output=pooled.embedding))
        end(request)
    return outputs
