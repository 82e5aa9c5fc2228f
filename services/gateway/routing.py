"""Routing policies: which replica a request goes to, and the cache-aware cost.

`load`: vLLM's DP score, `load = 4 * waiting + running` (waiting counts this gateway's own
sends since the replica's last load update). `round-robin`: each replica in turn.
`cache-aware`: among the replicas whose load is within `max_imbalance` of the least
loaded one, the lowest

    cost = prefill_weight * uncached_prompt_tokens + load_weight * load + kv_weight * kv_usage

where uncached_prompt_tokens is the prompt length minus the tokens of its longest prefix
cached on that replica (whole blocks, as its KV events report them) and kv_usage is the
fraction of its KV blocks in use (0..1). The cost is in tokens of prefill work: load_weight
says how many prompt tokens one unit of load is worth. The imbalance bound keeps a hot
prefix from piling every request onto one replica.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.common.block_hash import block_hashes


class RoutingPolicy(str, enum.Enum):
    LOAD = "load"
    CACHE_AWARE = "cache-aware"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True)
class RoutingConfig:
    """The gateway's `--routing*` flags."""

    policy: RoutingPolicy = RoutingPolicy.CACHE_AWARE
    prefill_weight: float = 1.0      # per uncached prompt token
    load_weight: float = 64.0        # per unit of load (4 per waiting request, 1 per running one)
    kv_weight: float = 256.0         # per unit of KV usage (0..1)
    max_imbalance: float = 32.0      # load above the least loaded replica's beyond which cache is ignored
    # P/D disaggregation: prompts with fewer uncached tokens on their decode replica are prefilled
    # there (a short prefill costs the decode batch less than a prefill replica's round trip does).
    remote_prefill_min_tokens: int = 256

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", RoutingPolicy(self.policy))  # "load" → the enum; bad → ValueError
        for name in ("prefill_weight", "load_weight", "kv_weight", "max_imbalance", "remote_prefill_min_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"--routing-{name.replace('_', '-')} must not be negative, got {getattr(self, name)}")


@dataclass
class RoutePrompt:
    """What cache-aware routing needs of a request: its prompt token ids and cache salt;
    block hashes are computed once per block size."""

    token_ids: Sequence[int]
    cache_salt: str = ""
    _hashes: dict[int, list[bytes]] = field(default_factory=dict, repr=False)

    def hashes(self, block_size: int) -> list[bytes]:
        """Hashes of the blocks a scheduler could serve from its cache: never the block of the
        last prompt token, which is always computed (its logits are needed)."""
        if block_size not in self._hashes:
            usable = (len(self.token_ids) - 1) // block_size * block_size
            self._hashes[block_size] = block_hashes(self.token_ids[:max(usable, 0)], block_size, self.cache_salt)
        return self._hashes[block_size]


@dataclass(frozen=True)
class Candidate:
    """One replica as the cost function sees it."""

    load: float
    kv_usage: float
    cached_tokens: int


def cost(config: RoutingConfig, num_prompt_tokens: int, c: Candidate) -> float:
    """The cache-aware cost of sending a `num_prompt_tokens` prompt to `c` (lower is better)."""
    uncached = max(num_prompt_tokens - c.cached_tokens, 0)
    return config.prefill_weight * uncached + config.load_weight * c.load + config.kv_weight * c.kv_usage


def choose_cache_aware(config: RoutingConfig, num_prompt_tokens: int, candidates: Sequence[Candidate]) -> int:
    """Index of the candidate to route to: the lowest cost among those within the imbalance
    bound (the first of equals, so callers decide ties by ordering)."""
    if not candidates:
        raise ValueError("no candidate replica")
    least = min(c.load for c in candidates)
    allowed = [i for i, c in enumerate(candidates) if c.load <= least + config.max_imbalance]
    return min(allowed, key=lambda i: cost(config, num_prompt_tokens, candidates[i]))
