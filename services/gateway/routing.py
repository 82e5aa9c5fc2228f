"""Routing policies: which replica a request goes to, and the cache-aware cost.

`load`: vLLM's DP score, `load = 4 * waiting + running` (waiting counts this gateway's own
sends since the replica's last load update). `round-robin`: each replica in turn.
`cache-aware`: among the replicas whose load is within `max_imbalance` of the least
loaded one, the lowest estimate of how long the request would wait for its first token there,
in seconds, from what each replica measures of itself (services/engine/step_pace.py: its mean
step time `step_s` and its prefill rate, prompt tokens per second of step time):

    cost = uncached_prompt_tokens / prefill_tokens_per_s     its own prefill
         + load / 4 * step_s                                 the queue ahead of it
         + kv_usage * step_s                                 KV pressure

- uncached_prompt_tokens: the prompt length minus the tokens of its longest prefix cached on
  that replica (whole blocks, as its KV events report them), divided by the rate that replica
  computes prompt tokens at: a slow replica's cache is worth more seconds than a fast one's.
- The queue, in steps: each waiting request ahead (its own or one this gateway just sent)
  costs about one step before this one gets its turn: the step that prefills it, or the share
  of a shared step its prefill takes; each running one a quarter of that: it only adds its
  decode token to every step. That is vLLM's 4:1 load score, read as waiting requests ahead
  (load / 4) and priced at the replica's measured step time, so both sides of the trade are in
  the same unit on any hardware: a prefix hit wins while the prefill it saves takes longer
  than the extra queue it joins.
- KV pressure: a replica whose cache is full must free blocks (preempt a running request, or
  let the newcomer wait) before admitting it; at full usage that costs about one step more,
  below it proportionally to the usage.

Before a replica has measured anything (it has not stepped yet) it borrows the mean of the
replicas that have; with none measured, defaults whose ratio keeps the trade of the earlier
token-weighted cost (a waiting request ahead worth 256 prompt tokens). The imbalance bound
keeps a hot prefix from piling every request onto one replica.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from services.common.block_hash import block_hashes


class RoutingPolicy(str, enum.Enum):
    LOAD = "load"
    CACHE_AWARE = "cache-aware"
    ROUND_ROBIN = "round-robin"


# vLLM's DP load score: a waiting request weighs as much as 4 running ones.
WAITING_WEIGHT = 4
# A replica's pace before any replica has measured its own: their ratio is what matters when
# every replica falls back to them (a waiting request ahead = one step = 256 prompt tokens).
DEFAULT_STEP_S = 0.1
DEFAULT_PREFILL_TOKENS_PER_S = 2560.0


@dataclass(frozen=True)
class RoutingConfig:
    """The gateway's `--routing*` flags."""

    policy: RoutingPolicy = RoutingPolicy.CACHE_AWARE
    max_imbalance: float = 32.0      # load above the least loaded replica's beyond which cache is ignored
    # P/D disaggregation: prompts with fewer uncached tokens on their decode replica are prefilled
    # there (a short prefill costs the decode batch less than a prefill replica's round trip does).
    remote_prefill_min_tokens: int = 256

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", RoutingPolicy(self.policy))  # "load" → the enum; bad → ValueError
        for name in ("max_imbalance", "remote_prefill_min_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"--routing-{name.replace('_', '-')} must not be negative, got {getattr(self, name)}")


@dataclass
class RoutePrompt:
    """What cache-aware routing needs of a request: its prompt token ids, cache salt and LoRA
    adapter's key (`block_hash.adapter_key`); block hashes are computed once per block size."""

    token_ids: Sequence[int]
    cache_salt: str = ""
    lora_key: str = ""
    _hashes: dict[int, list[bytes]] = field(default_factory=dict, repr=False)

    def hashes(self, block_size: int) -> list[bytes]:
        """Hashes of the blocks a scheduler could serve from its cache: never the block of the
        last prompt token, which is always computed (its logits are needed)."""
        if block_size not in self._hashes:
            usable = (len(self.token_ids) - 1) // block_size * block_size
            self._hashes[block_size] = block_hashes(self.token_ids[:max(usable, 0)], block_size, self.cache_salt,
                                                    self.lora_key)
        return self._hashes[block_size]


@dataclass(frozen=True)
class Candidate:
    """One replica as the cost function sees it; a pace of 0.0 is not measured yet."""

    load: float
    kv_usage: float
    cached_tokens: int
    prefill_tokens_per_s: float = 0.0
    step_s: float = 0.0


def cost(num_prompt_tokens: int, c: Candidate) -> float:
    """Seconds to the first token of a `num_prompt_tokens` prompt sent to `c` (lower is better);
    `c` measured (see `with_measured_pace`)."""
    uncached = max(num_prompt_tokens - c.cached_tokens, 0)
    return uncached / c.prefill_tokens_per_s + (c.load / WAITING_WEIGHT + c.kv_usage) * c.step_s


def with_measured_pace(candidates: Sequence[Candidate]) -> list[Candidate]:
    """`candidates`, each unmeasured pace replaced by the mean of the measured ones (the
    defaults where none is)."""
    rates = [c.prefill_tokens_per_s for c in candidates if c.prefill_tokens_per_s > 0]
    steps = [c.step_s for c in candidates if c.step_s > 0]
    rate = sum(rates) / len(rates) if rates else DEFAULT_PREFILL_TOKENS_PER_S
    step_s = sum(steps) / len(steps) if steps else DEFAULT_STEP_S
    return [replace(c, prefill_tokens_per_s=c.prefill_tokens_per_s if c.prefill_tokens_per_s > 0 else rate,
                    step_s=c.step_s if c.step_s > 0 else step_s) for c in candidates]


def choose_cache_aware(config: RoutingConfig, num_prompt_tokens: int, candidates: Sequence[Candidate]) -> int:
    """Index of the candidate to route to: the lowest cost among those within the imbalance
    bound (the first of equals, so callers decide ties by ordering)."""
    if not candidates:
        raise ValueError("no candidate replica")
    measured = with_measured_pace(candidates)
    least = min(c.load for c in measured)
    allowed = [i for i, c in enumerate(measured) if c.load <= least + config.max_imbalance]
    return min(allowed, key=lambda i: cost(num_prompt_tokens, measured[i]))
