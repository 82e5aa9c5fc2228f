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

from services.common.proto import myvllm_pb2 as pb
from services.common.spec_config import SpeculativeConfig, may_speculate
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


class SpecDecodeHooks:
    """What the scheduler's token-budget loop asks of speculative decoding (inert when it is off):
    the drafts each running request brings to a step, the KV slots a draft model needs past
    them, and, from a step's output, the rejected drafts given back and the next drafts."""

    def __init__(self, config: SpeculativeConfig | None, max_model_len: int, async_scheduling: bool) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.async_scheduling = async_scheduling
        self.num_lookahead_slots = lookahead_slots(config)
        self.num_drafts = drafts_per_step(config)
        self.stats = SpecDecodeStats(self.num_drafts)

    def drafts_off(self, num_running: int) -> bool:
        """speculative_config.disable_by_batch_size: no drafts while that many requests run."""
        limit = self.config.disable_by_batch_size if self.config else 0
        return bool(limit) and num_running >= limit

    def drafts_for_step(self, running: list[Request]) -> None:
        """The drafts each running request may bring to this step. Above disable_by_batch_size
        running requests, none (verification costs more than it saves in a large batch); else
        not past what the request may still output. With async scheduling a request whose step
        is in flight cannot know its drafts yet: it holds WORKER_DRAFT placeholders, as many
        as the worker may verify of its own."""
        if self.config is None:
            return
        off = self.drafts_off(len(running))
        for request in running:
            keep = 0 if off else max_drafts(request, self.max_model_len)
            if request.num_output_placeholders and self.async_scheduling:
                may = may_speculate(request.sampling, request.num_output_tokens)
                request.spec_token_ids = worker_drafts(min(keep, self.config.num_speculative_tokens) if may else 0)
            elif request.spec_token_ids:
                del request.spec_token_ids[keep:]

    def lookahead(self, request: Request, num_new: int) -> int:
        """Extra KV slots past this step's tokens for a draft model's own draft positions,
        never past max_model_len."""
        if not self.num_lookahead_slots:
            return 0
        return max(min(self.num_lookahead_slots, self.max_model_len - request.num_computed_tokens - num_new), 0)

    def step_drafts(self, scheduler_output: pb.SchedulerOutput, runner_output: pb.ModelRunnerOutput) -> StepDrafts:
        return StepDrafts(scheduler_output, runner_output, self.stats)


class StepDrafts:
    """One step's drafts as scheduled and as the worker verified them."""

    def __init__(self, scheduler_output: pb.SchedulerOutput, runner_output: pb.ModelRunnerOutput,
                 stats: SpecDecodeStats) -> None:
        cached = scheduler_output.cached_requests
        self.scheduled = {c.request_id: len(c.spec_token_ids) or c.num_worker_drafts
                          for c in cached if c.spec_token_ids or c.num_worker_drafts}
        self.worker_drafted = {c.request_id for c in cached if c.num_worker_drafts}
        self.num_verified = runner_output.num_draft_tokens
        self.proposed = runner_output.spec_token_ids
        self.stats = stats

    def settle(self, i: int, request: Request, num_produced: int) -> None:
        """Request `i` of the output produced `num_produced` tokens: the slots of its rejected
        drafts are given back (the next step recomputes those positions; with worker drafts,
        those it did not have count as rejected), placeholders of a step in flight are resolved
        (async scheduling), and the verification counted."""
        rid = request.request_id
        num_draft = self.scheduled.get(rid, 0)
        if request.num_output_placeholders:  # (async scheduling) this step's are now known
            request.num_output_placeholders = max(request.num_output_placeholders - 1 - num_draft, 0)
            request.num_drafts_in_flight = max(request.num_drafts_in_flight - num_draft, 0)
        if num_draft:
            request.num_computed_tokens -= num_draft + 1 - num_produced
            # The worker says how many it verified; a worker's own may have been fewer, or none.
            verified = self.num_verified[i] if i < len(self.num_verified) else \
                0 if rid in self.worker_drafted else num_draft
            if verified:
                self.stats.observe(verified, num_produced - 1)

    def next_drafts(self, i: int, request: Request, finished: bool) -> None:
        """The drafts request `i` brings to its next step: those proposed after this one (with a
        step of it still in flight the worker keeps its own: WORKER_DRAFT)."""
        request.spec_token_ids = []
        if not finished and i < len(self.proposed) and not request.num_output_placeholders:
            request.spec_token_ids = list(self.proposed[i].ids)
