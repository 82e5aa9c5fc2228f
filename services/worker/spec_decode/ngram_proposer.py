"""N-gram (prompt lookup) proposer: drafts are the tokens that followed the latest earlier
occurrence of the request's own last n tokens, for the longest n in [min_n, max_n] that occurs.

Nothing but the request's tokens is needed, which makes it free to run and strong wherever the
output repeats its context (rewriting, editing, code, extraction).
"""

from __future__ import annotations

import numpy as np


def longest_suffix_match(tokens: np.ndarray, min_n: int, max_n: int) -> tuple[int, int]:
    """(end, n): `tokens[end - n + 1:end + 1]` equals the last n tokens, with end < len - 1 the
    latest such position for the longest n <= max_n; n = 0 when no match of min_n exists.

    Vectorised over every candidate end: one pass per suffix length t (at most max_n passes of
    `len` compares), never a Python loop over the context.
    """
    length = tokens.size
    if length < min_n + 1:
        return -1, 0
    ends = np.arange(length - 1)  # a candidate occurrence ends at `end` and is followed by a token
    match_len = np.zeros(length - 1, dtype=np.int64)
    alive = np.ones(length - 1, dtype=bool)
    for t in range(min(max_n, length - 1)):
        pos = ends - t
        alive &= pos >= 0
        alive[alive] = tokens[pos[alive]] == tokens[length - 1 - t]
        if not alive.any():
            break
        match_len += alive
    best = int(match_len.max())
    if best < min_n:
        return -1, 0
    return int(np.flatnonzero(match_len == best)[-1]), best


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose_one(self, tokens: np.ndarray) -> list[int]:
        """Up to k drafts following the best earlier match of `tokens`' suffix (none: [])."""
        end, n = longest_suffix_match(tokens, self.min_n, self.max_n)
        if n == 0:
            return []
        return tokens[end + 1:end + 1 + self.k].tolist()

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray, rows: list[int]) -> list[list[int]]:
        """Drafts for each of `rows` of the persistent batch (`token_ids[row, :num_tokens[row]]`)."""
        return [self.propose_one(token_ids[row, :num_tokens[row]]) for row in rows]
