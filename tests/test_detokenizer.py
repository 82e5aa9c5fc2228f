"""Incremental detokenization must equal a full decode and never show broken UTF-8."""

from __future__ import annotations

import random

import pytest

from services.text.detokenizer import MAX_UNREAD_TOKENS, IncrementalDetokenizer
from services.text.tokenizer import Tokenizer

MULTILINGUAL_TEXTS = [
    "Hello 世界 🎉! How are you today?",
    "naïve café – “quotes” … 😀😃😄 👩‍👩‍👧‍👦 flag 🇫🇷",
    "日本語のテキストと中文字符混合，还有한국어도 있어요。",
    "math: ∑ᵢ xᵢ² ≥ 0, arrows → ⇒ ⟹, emoji in a word: ab🎉cd",
    "  leading spaces\n\ttabs\nnew lines\r\n  and   runs of   spaces  ",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: str) -> Tokenizer:
    return Tokenizer.load(smollm2_dir)


def detokenize(tokenizer: Tokenizer, prompt: list[int], output: list[int],
               skip_special_tokens: bool = True) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
    pieces = [detokenizer.add(token_id) for token_id in output]
    pieces.append(detokenizer.flush())
    return pieces


@pytest.mark.parametrize("text", MULTILINGUAL_TEXTS)
def test_multibyte_characters_split_across_tokens(tokenizer: Tokenizer, text: str) -> None:
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    # The test is only meaningful if some character really is split over tokens.
    assert any("\ufffd" in tokenizer.token_text(t) for t in token_ids) or text.isascii()
    pieces = detokenize(tokenizer, [], token_ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces), pieces


@pytest.mark.parametrize("text", MULTILINGUAL_TEXTS)
def test_prompt_context_does_not_leak_into_output(tokenizer: Tokenizer, text: str) -> None:
    prompt = tokenizer.encode("<|im_start|>user\nSay something 🎉<|im_end|>\n<|im_start|>assistant\n",
                              add_special_tokens=False)
    output = tokenizer.encode(text, add_special_tokens=False)
    assert "".join(detokenize(tokenizer, prompt, output)) == text


def _random_stream(rng: random.Random, tokenizer: Tokenizer, length: int) -> list[int]:
    # Mix whole-word tokens, single-byte tokens (pieces of multi-byte characters),
    # pieces of real CJK / emoji text, and special tokens.
    byte_tokens = [t for t in range(tokenizer.vocab_size) if len(tokenizer.token_bytes(t)) == 1][:256]
    split_text = [t for text in MULTILINGUAL_TEXTS for t in tokenizer.encode(text, add_special_tokens=False)]
    special = sorted(tokenizer.hf_tokenizer.all_special_ids)
    stream = []
    for _ in range(length):
        kind = rng.random()
        if kind < 0.35:
            stream.append(rng.randrange(tokenizer.vocab_size))
        elif kind < 0.6:
            stream.append(rng.choice(byte_tokens))
        elif kind < 0.95:
            start = rng.randrange(len(split_text))
            stream.extend(split_text[start:start + rng.randint(1, 6)])
        else:
            stream.append(rng.choice(special))
    return stream


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_streams_match_full_decode(tokenizer: Tokenizer, seed: int, skip_special_tokens: bool) -> None:
    rng = random.Random(seed)
    output = _random_stream(rng, tokenizer, 200)
    pieces = detokenize(tokenizer, [], output, skip_special_tokens)
    assert "".join(pieces) == tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
    # Every piece but the final flush ends on a whole character.
    assert not any(piece.endswith("\ufffd") for piece in pieces[:-1])


@pytest.mark.parametrize("seed", range(5))
def test_random_streams_after_a_prompt(tokenizer: Tokenizer, seed: int) -> None:
    rng = random.Random(1000 + seed)
    prompt = tokenizer.encode("The answer is", add_special_tokens=False)
    output = _random_stream(rng, tokenizer, 100)
    expected = tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)):]
    assert "".join(detokenize(tokenizer, prompt, output)) == expected


def test_special_tokens_shown_only_when_not_skipped(tokenizer: Tokenizer) -> None:
    output = tokenizer.encode("Hi", add_special_tokens=False) + [2]  # <|im_end|>
    assert "".join(detokenize(tokenizer, [], output, skip_special_tokens=True)) == "Hi"
    assert "".join(detokenize(tokenizer, [], output, skip_special_tokens=False)) == "Hi<|im_end|>"


def test_trailing_partial_character_is_flushed_like_a_full_decode(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("ok 🎉", add_special_tokens=False)[:-1]  # drop the emoji's last byte
    pieces = detokenize(tokenizer, [], token_ids)
    assert "\ufffd" not in "".join(pieces[:-1])
    assert "".join(pieces) == tokenizer.decode(token_ids)


def test_window_stays_bounded_for_long_outputs(tokenizer: Tokenizer) -> None:
    chunk = tokenizer.encode(MULTILINGUAL_TEXTS[0] + " ", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [], True)
    longest_window = 0
    text = []
    for _ in range(300):
        for token_id in chunk:
            text.append(detokenizer.add(token_id))
            longest_window = max(longest_window, len(detokenizer._window))
    assert "".join(text) == (MULTILINGUAL_TEXTS[0] + " ") * 300
    assert longest_window <= MAX_UNREAD_TOKENS  # not growing with the output


def test_long_run_of_skipped_special_tokens_keeps_window_bounded(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [], True)
    pieces = [detokenizer.add(2) for _ in range(1000)]
    pieces += [detokenizer.add(t) for t in tokenizer.encode(" done", add_special_tokens=False)]
    assert "".join(pieces) == " done"
    assert len(detokenizer._window) <= MAX_UNREAD_TOKENS + 1
