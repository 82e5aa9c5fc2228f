"""Incremental detokenization must equal a full decode and never show broken UTF-8."""

from __future__ import annotations

import codecs
import random

import pytest

from services.common.proto import myvllm_pb2 as pb
from services.common.sampling_params import SamplingParams
from services.text.detokenizer import MAX_UNREAD_TOKENS, IncrementalDetokenizer, ends_mid_character
from services.text.output_processor import ChoiceOutputProcessor
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


def _cut_at_end(tokenizer: Tokenizer, output: list[int], skip_special_tokens: bool) -> bool:
    """Whether the raw bytes of `output` (as the decode sees them) end mid-character, by
    Python's own UTF-8 codec: the bytes it leaves unconsumed when told more may follow."""
    special = set(tokenizer.hf_tokenizer.all_special_ids) if skip_special_tokens else set()
    data = b"".join(tokenizer.token_bytes(t) for t in output if t not in special)
    _, consumed = codecs.utf_8_decode(data, "replace", False)
    return consumed < len(data)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_streams_match_full_decode(tokenizer: Tokenizer, seed: int, skip_special_tokens: bool) -> None:
    rng = random.Random(seed)
    output = _random_stream(rng, tokenizer, 200)
    pieces = detokenize(tokenizer, [], output, skip_special_tokens)
    expected = tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
    if _cut_at_end(tokenizer, output, skip_special_tokens):
        assert expected.endswith("\ufffd")
        expected = expected[:-1]  # the cut character's U+FFFD is held back for good
    assert "".join(pieces) == expected
    # Every piece but the final flush ends on a whole character.
    assert not any(piece.endswith("\ufffd") for piece in pieces[:-1])


@pytest.mark.parametrize("seed", range(40))
def test_random_streams_cut_anywhere(tokenizer: Tokenizer, seed: int) -> None:
    """Cut after any token (as max_tokens would): the text is the full decode, less the
    U+FFFD of a character cut short."""
    rng = random.Random(2000 + seed)
    output = _random_stream(rng, tokenizer, 60)
    output = output[:rng.randrange(1, len(output) + 1)]
    expected = tokenizer.decode(output)
    if _cut_at_end(tokenizer, output, True):
        expected = expected[:-1]
    assert "".join(detokenize(tokenizer, [], output)) == expected


@pytest.mark.parametrize("seed", range(5))
def test_random_streams_after_a_prompt(tokenizer: Tokenizer, seed: int) -> None:
    rng = random.Random(1000 + seed)
    prompt = tokenizer.encode("The answer is", add_special_tokens=False)
    output = _random_stream(rng, tokenizer, 100)
    expected = tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)):]
    if _cut_at_end(tokenizer, output, True):
        expected = expected[:-1]
    assert "".join(detokenize(tokenizer, prompt, output)) == expected


def test_special_tokens_shown_only_when_not_skipped(tokenizer: Tokenizer) -> None:
    output = tokenizer.encode("Hi", add_special_tokens=False) + [2]  # <|im_end|>
    assert "".join(detokenize(tokenizer, [], output, skip_special_tokens=True)) == "Hi"
    assert "".join(detokenize(tokenizer, [], output, skip_special_tokens=False)) == "Hi<|im_end|>"


def test_a_character_cut_at_the_end_is_held_back(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("🌍🌍🌍", add_special_tokens=False)
    assert len(token_ids) == 9  # three tokens per emoji: F0 9F | 8C | 8D
    for cut in range(1, len(token_ids) + 1):
        pieces = detokenize(tokenizer, [], token_ids[:cut])
        assert "".join(pieces) == "🌍" * (cut // 3), (cut, pieces)
    assert tokenizer.decode(token_ids[:8]) == "🌍🌍\ufffd"  # what a full decode makes of the cut one


def test_a_generated_replacement_character_is_kept(tokenizer: Tokenizer) -> None:
    [fffd] = tokenizer.encode("\ufffd", add_special_tokens=False)  # one token: the bytes EF BF BD
    ok = tokenizer.encode("ok", add_special_tokens=False)
    cut_emoji = tokenizer.encode("🌍", add_special_tokens=False)[:2]
    assert "".join(detokenize(tokenizer, [], ok + [fffd])) == "ok\ufffd"
    assert "".join(detokenize(tokenizer, [], ok + [fffd, fffd])) == "ok\ufffd\ufffd"
    assert "".join(detokenize(tokenizer, [], [fffd] + ok)) == "\ufffdok"
    # A whole U+FFFD before a cut character: only the cut one goes.
    assert "".join(detokenize(tokenizer, [], ok + [fffd] + cut_emoji)) == "ok\ufffd"
    # Invalid bytes that no more bytes could complete (a lone continuation byte) are not held back.
    [continuation] = [t for t in range(tokenizer.vocab_size) if tokenizer.token_bytes(t) == b"\x8c"]
    assert "".join(detokenize(tokenizer, [], ok + [continuation])) == "ok\ufffd"


def test_a_cut_character_before_a_skipped_special_token_is_held_back(tokenizer: Tokenizer) -> None:
    cut_emoji = tokenizer.encode("🌍", add_special_tokens=False)[:2]
    assert "".join(detokenize(tokenizer, [], [*cut_emoji, 2], skip_special_tokens=True)) == ""
    # Shown, the special token ends the text: the cut character is in the middle, as in a full decode.
    assert "".join(detokenize(tokenizer, [], [*cut_emoji, 2], skip_special_tokens=False)) == "\ufffd<|im_end|>"


def test_ends_mid_character() -> None:
    assert ends_mid_character("🌍".encode()[:3]) and ends_mid_character(b"ok\xc3")
    assert not ends_mid_character(b"ok") and not ends_mid_character("\ufffd".encode())
    assert not ends_mid_character(b"\x8c") and not ends_mid_character(b"\xe0\x80")  # can never complete


@pytest.mark.parametrize("finish_reason", ["length", "stop", "abort"])
def test_output_processor_streams_and_finishes_without_a_cut_character(tokenizer: Tokenizer,
                                                                        finish_reason: str) -> None:
    """Streamed deltas (one engine step each, 1-3 tokens) concatenate to the final text, and
    neither ends in the U+FFFD of a character cut by the end of the output."""
    ids = tokenizer.encode("Hi 🌍🌍🌍", add_special_tokens=False)
    cut = ids[:-1]  # the last emoji loses its last byte
    if finish_reason == "stop":
        cut = cut + [2]  # EOS: its text is hidden, the cut character before it too
    processor = ChoiceOutputProcessor(0, tokenizer, tokenizer.encode("Say hi", add_special_tokens=False),
                                      SamplingParams(max_tokens=len(cut)))
    deltas, steps = [], [cut[i:i + 2] for i in range(0, len(cut), 2)]
    for n, step in enumerate(steps):
        last = n == len(steps) - 1
        deltas.append(processor.process(pb.RequestOutput(
            request_id="r", new_token_ids=step, finish_reason=finish_reason if last else "",
            stop_token_id=2 if last and finish_reason == "stop" else -1)))
    assert "".join(d.text for d in deltas) == "Hi 🌍🌍"
    assert not any("\ufffd" in d.text for d in deltas), [d.text for d in deltas]
    assert deltas[-1].finish_reason == finish_reason
    assert [t for d in deltas for t in d.token_ids] == cut  # the token ids are all reported


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
