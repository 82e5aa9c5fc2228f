"""How fast this engine steps, measured from its own steps, for the gateway's cache-aware routing
(which costs a replica in seconds: services/gateway/routing.py).

Two exponentially weighted figures, published with the load (`Load.step_s`,
`Load.prefill_tokens_per_s`; 0 until measured):

- `step_s`: the mean duration of a step that computed tokens. A request queued behind others
  waits for steps, so the gateway prices its wait in steps.
- `prefill_tokens_per_s`: prompt tokens computed per second of the time they add to a step: a
  step's duration less a decode-only step's (the part every step pays whatever it prefills:
  the running requests' tokens, the round trip to the worker), over the prompt tokens it
  computed. Sums decayed per prefilling step, so a large prefill weighs more than a step
  that computed a few uncached tokens after a prefix hit.

A step lasts from when it could start computing, the later of its scheduling and the end of
the step before it (with async scheduling or pipeline stages the next step is scheduled while
one computes), to when its output is processed: the round trip to the worker is part of what
a request waits for.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

# Weight of the newest step in each average: about the last ten steps count.
ALPHA = 0.2
# The prefill share of a step counts as at least this fraction of it: a decode-only baseline
# that is momentarily as slow as the step must not make prompt tokens look free.
MIN_PREFILL_SHARE = 0.1


class StepPace:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._pending: dict[int, tuple[float, int]] = {}  # step id -> (scheduled at, prompt tokens)
        self._last_end = 0.0
        self.step_s = 0.0           # 0: not measured yet
        self.decode_step_s = 0.0    # the same, over steps that computed no prompt token
        self._prompt_tokens = 0.0   # decayed sums over prefilling steps
        self._prefill_seconds = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second of step time they add (0.0 until a step prefilled)."""
        return self._prompt_tokens / self._prefill_seconds if self._prefill_seconds > 0 else 0.0

    def scheduled(self, step_id: int, prompt_tokens: int) -> None:
        """A step that computes tokens, `prompt_tokens` of them prompt positions, goes out now."""
        self._pending[step_id] = (self._clock(), prompt_tokens)

    def processed(self, step_id: int) -> None:
        """The output of step `step_id` is back (a step not passed to `scheduled` only ends the
        previous one's turn)."""
        now = self._clock()
        entry = self._pending.pop(step_id, None)
        start, self._last_end = self._last_end, now
        if entry is None:
            return
        scheduled_at, prompt_tokens = entry
        duration = now - max(scheduled_at, start)
        if duration <= 0:
            return
        self.step_s = _average(self.step_s, duration)
        if prompt_tokens == 0:
            self.decode_step_s = _average(self.decode_step_s, duration)
            return
        prefill_s = max(duration - self.decode_step_s, MIN_PREFILL_SHARE * duration)
        self._prompt_tokens = (1 - ALPHA) * self._prompt_tokens + prompt_tokens
        self._prefill_seconds = (1 - ALPHA) * self._prefill_seconds + prefill_s

    def forget_in_flight(self) -> None:
        """The steps in flight will never be processed (the worker failed); the averages stay."""
        self._pending.clear()
        self._last_end = 0.0


def _average(current: float, sample: float) -> float:
    return sample if current == 0.0 else (1 - ALPHA) * current + ALPHA * sample


def prompt_positions(starts: Sequence[int], counts: Sequence[int], prompt_lens: Sequence[int]) -> int:
    """How many of a step's tokens are prompt positions: request i computes `counts[i]` tokens
    from position `starts[i]` of a `prompt_lens[i]`-token prompt (a preempted request's
    recomputed output tokens are not prompt)."""
    return sum(max(min(start + count, length) - start, 0)
               for start, count, length in zip(starts, counts, prompt_lens, strict=True))
