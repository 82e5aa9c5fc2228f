"""Token-level stops, checked as each sampled token is appended (vLLM's sched/utils check_stop);
stop strings are the gateway's (they need text)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from services.engine.request import Request, RequestStatus


def check_stop(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """EOS or a stop token (once min_tokens are out), or max_tokens / the context reached."""
    if request.num_output_tokens >= request.min_tokens and (
            token_id in request.eos_token_ids or token_id in request.stop_token_ids):
        request.stop_token_id = token_id
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def append_output_tokens(request: Request, tokens: Iterable[int], max_model_len: int,
                         advance_grammar: Callable[[Request, int], RequestStatus | None]
                         ) -> tuple[list[int], RequestStatus | None]:
    """Append a step's tokens one at a time, so that a stop ends the request where it would
    without drafts: (the tokens appended, the status that ended it or None)."""
    new_token_ids: list[int] = []
    status = None
    for token_id in tokens:
        request.append_output_token(token_id)
        new_token_ids.append(token_id)
        status = check_stop(request, token_id, max_model_len)
        if request.grammar is not None and status != RequestStatus.FINISHED_STOPPED:
            status = advance_grammar(request, token_id) or status
        if status is not None:
            break
    return new_token_ids, status
