"""Perplexity by llama-perplexity's method: the windows it cuts, the half of each it scores, and
the mean over them, on an engine stand-in whose log-probabilities are known."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from services.offline.outputs import Logprob
from services.offline.perplexity import perplexity, score_window, windows


def test_windows_are_whole_consecutive_and_start_with_bos_when_asked() -> None:
    ids = list(range(100, 125))  # 25 tokens: three whole windows of 8, one token left over
    assert windows(ids, 8) == [ids[0:8], ids[8:16], ids[16:24]]
    assert windows(ids, 8, n_chunks=2) == [ids[0:8], ids[8:16]]
    assert [w[0] for w in windows(ids, 8, bos_token_id=1)] == [1, 1, 1]
    assert windows(ids, 8, bos_token_id=1)[1][1:] == ids[9:16]
    with pytest.raises(ValueError, match="at least 52 tokens"):
        windows(ids, 26)


def test_a_window_scores_its_second_half() -> None:
    # n_ctx 8: first = 4, so positions 5, 6, 7 (each predicted from all before it) are scored.
    logprobs = [None, -9.0, -9.0, -9.0, -9.0, -1.0, -2.0, -3.0]
    assert score_window(logprobs) == (6.0, 3)
    # n_ctx odd: first = n_ctx // 2, as llama.cpp's integer division.
    assert score_window([None, -5.0, -5.0, -1.0, -1.0]) == (2.0, 2)


class _FakeLLM:
    """Tokenizes a text as its character codes and gives each prompt token the log-probability
    -(token % 7) / 10, whatever precedes it."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def get_tokenizer(self):
        return SimpleNamespace(encode=lambda text: [ord(c) for c in text])

    def generate(self, prompts, params, use_tqdm: bool = False):
        assert params.prompt_logprobs == 0
        outputs = []
        for prompt in prompts:
            ids = prompt["prompt_token_ids"]
            self.prompts.append(ids)
            entries = [None] + [{t: Logprob(-(t % 7) / 10, rank=1)} for t in ids[1:]]
            outputs.append(SimpleNamespace(prompt_logprobs=entries))
        return outputs


def test_perplexity_is_the_exponent_of_the_mean_over_scored_tokens() -> None:
    llm = _FakeLLM()
    text = "".join(chr(97 + (i * 5) % 26) for i in range(70))
    result = perplexity(llm, text, n_ctx=16)
    ids = [ord(c) for c in text]
    scored = [t for w in range(4) for t in ids[w * 16 + 9:(w + 1) * 16]]  # positions 9..15 of each window
    assert result.n_chunks == 4 and result.count == len(scored) == 28
    assert result.nll == pytest.approx(sum((t % 7) / 10 for t in scored))
    assert result.ppl == pytest.approx(math.exp(result.nll / 28))
    assert llm.prompts == [ids[0:16], ids[16:32], ids[32:48], ids[48:64]]
