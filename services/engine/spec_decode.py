"""The scheduler's side of speculative decoding: how many drafts a request may carry into a
step, and the acceptance counters behind the spec_decode metrics.

Drafts are scheduled as extra tokens of their request (KV slots allocated like any other
token). After the step the worker reports how many tokens each request produced; the
`num_draft + 1 - num_produced` rejected positions are given back by rolling
`num_computed_tokens` back, so the next step overwrites their KV.

With async scheduling, step N+1 is scheduled while step N is in flight: N's drafts (proposed by
the worker after N samples) and how many N accepts are unknown. The request then carries
WORKER_DRAFT placeholders into N+1: the worker verifies up to that many of its own drafts.
The scheduler counts N as producing 1 + its drafts tokens (num_output_placeholders) and N+1
as starting after them; both are upper bounds, corrected like any rejection when N's output
arrives, and the worker runs N+1 from its own counts (vLLM's async scheduling with spec decode).
"""

from __future__ import annotations

from services.common.spec_config import SpeculativeConfig
from services.engine.request import Request

# A draft the scheduler does not know: one the worker proposed after a step still in flight.
WORKER_DRAFT = -1


def worker_drafts(n: int) -> list[int]:
    """Placeholders for n of the worker's own drafts."""
    return [WORKER_DRAFT] * n


def max_drafts(request: Request, max_model_len: int) -> int:
    """Drafts worth verifying: every accepted draft plus the bonus token is an output, so more
    than max_tokens (or max_model_len) allows would be computed for nothing, and the bonus
    token's slot in the worker's token array must stay below max_model_len. Tokens of steps in
    flight count at their most."""
    pending = request.num_output_placeholders
    by_length = max_model_len - request.num_tokens - pending - 1
    by_max_tokens = request.max_tokens - request.num_output_tokens - pending - 1
    return max(min(by_length, by_max_tokens), 0)


class SpecDecodeStats:
    """Counters since start: verification rounds, draft tokens, accepted ones, and accepted by position."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    def as_dict(self) -> dict[str, object]:
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_accepted_per_pos": list(self.accepted_per_pos)}


def drafts_per_step(config: SpeculativeConfig | None) -> int:
    """Draft tokens a request may carry into a step (0: speculation off)."""
    return config.num_speculative_tokens if config is not None else 0


def lookahead_slots(config: SpeculativeConfig | None) -> int:
    """KV slots to allocate past a step's tokens: a draft model writes its own KV for the k-1
    draft positions it runs after the step (an n-gram proposer writes none)."""
    if config is None or config.method != "draft_model":
        return 0
    return config.num_speculative_tokens
