"""Perplexity of the engine over a text, by llama.cpp's `llama-perplexity` method, so the two
numbers compare directly (a quantized checkpoint's quality against llama.cpp's on the same file).

llama-perplexity tokenizes the whole text once, cuts it into consecutive windows of `n_ctx`
tokens (as many whole windows as fit; it needs at least two), replaces each window's first
token by BOS when the vocabulary adds one, evaluates every window from an empty cache and scores
only its second half: the tokens at positions n_ctx/2 + 1 .. n_ctx - 1, each predicted from all
the window's tokens before it, so every scored token has at least half a window of context.
Perplexity is exp(mean negative log-likelihood over the scored tokens). Here the engine's prompt
logprobs give each window position's log-probability in one prefill.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.offline.llm import LLM

__all__ = ["PerplexityResult", "perplexity", "score_window", "windows"]


@dataclass(frozen=True)
class PerplexityResult:
    """The negative log-likelihood summed over the scored tokens, and how many were scored."""

    nll: float
    count: int
    n_chunks: int

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)


def windows(token_ids: Sequence[int], n_ctx: int, n_chunks: int | None = None,
            bos_token_id: int | None = None) -> list[list[int]]:
    """The consecutive `n_ctx`-token windows llama-perplexity evaluates (the tail that fills no
    whole window is dropped), at most `n_chunks` of them, each starting with BOS when given."""
    if n_ctx < 4:
        raise ValueError(f"n_ctx must be at least 4, got {n_ctx}")
    if len(token_ids) < 2 * n_ctx:
        raise ValueError(f"perplexity over windows of {n_ctx} tokens needs at least {2 * n_ctx} tokens, "
                         f"the text has {len(token_ids)}")
    count = len(token_ids) // n_ctx
    if n_chunks is not None:
        count = min(count, n_chunks)
    out = [list(token_ids[i * n_ctx:(i + 1) * n_ctx]) for i in range(count)]
    if bos_token_id is not None:
        for window in out:
            window[0] = bos_token_id
    return out


def score_window(token_logprobs: Sequence[float | None]) -> tuple[float, int]:
    """(negative log-likelihood, tokens scored) of one window from each position's log-probability
    of its own token given the positions before it (position 0 has none): positions
    n_ctx/2 + 1 .. n_ctx - 1, llama-perplexity's second half."""
    n_ctx = len(token_logprobs)
    first = n_ctx // 2
    scored = token_logprobs[first + 1:]
    return -math.fsum(scored), len(scored)


def perplexity(llm: LLM, text: str, n_ctx: int = 512, n_chunks: int | None = None,
               bos_token_id: int | None = None) -> PerplexityResult:
    """Perplexity of `llm` over `text` by llama-perplexity's method. `bos_token_id`: the model's
    BOS when its vocabulary adds one (llama.cpp's add_bos_token), None when it adds none; the
    engine must admit prompts of `n_ctx` tokens."""
    from services.common.sampling_params import SamplingParams

    token_ids = llm.get_tokenizer().encode(text)
    chunks = windows(token_ids, n_ctx, n_chunks, bos_token_id)
    # One token generated (the engine's minimum): only the prompt logprobs count, k = 0 giving just
    # each prompt token's own.
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": w} for w in chunks], params, use_tqdm=False)
    nll, count = 0.0, 0
    for window, output in zip(chunks, outputs, strict=True):
        logprobs = [None] + [entry[token].logprob for token, entry in zip(window[1:], output.prompt_logprobs[1:],
                                                                           strict=True)]
        window_nll, window_count = score_window(logprobs)
        nll += window_nll
        count += window_count
    return PerplexityResult(nll, count, len(chunks))
