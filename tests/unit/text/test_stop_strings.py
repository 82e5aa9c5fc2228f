"""Stop strings across streamed chunks (unit tests of the matcher)."""

from __future__ import annotations

import random

import pytest

from services.text.stop import StopStringMatcher


def run(matcher: StopStringMatcher, chunks: list[str]) -> tuple[list[str], str | None]:
    """Feed chunks until a match; returns what was emitted per call and the match."""
    emitted = []
    for chunk in chunks:
        text, matched = matcher.feed(chunk)
        emitted.append(text)
        if matched is not None:
            return emitted, matched
    emitted.append(matcher.flush())
    return emitted, None


def test_no_stop_strings_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("hello") == ("hello", None)
    assert matcher.flush() == ""


def test_stop_inside_one_chunk_truncates_before_it() -> None:
    emitted, matched = run(StopStringMatcher(["STOP"]), ["abc STOP def"])
    assert (emitted, matched) == (["abc "], "STOP")


def test_stop_spanning_chunks() -> None:
    emitted, matched = run(StopStringMatcher(["world"]), ["hello w", "or", "ld!"])
    assert matched == "world"
    assert "".join(emitted) == "hello "


def test_only_a_possible_stop_prefix_is_held_back() -> None:
    matcher = StopStringMatcher(["world"])
    assert matcher.feed("hello wor") == ("hello ", None)  # "wor" might become "world"
    assert matcher.feed("k") == ("work", None)  # ... it did not
    assert matcher.feed("s fine") == ("s fine", None)  # nothing can start a stop here


def test_held_back_text_is_released_at_the_end() -> None:
    matcher = StopStringMatcher(["</end>"])
    assert matcher.feed("text </e") == ("text ", None)
    assert matcher.flush() == "</e"


def test_include_stop_str_in_output() -> None:
    emitted, matched = run(StopStringMatcher(["world"], include_stop_str_in_output=True), ["hello wo", "rld and more"])
    assert "".join(emitted) == "hello world"
    assert matched == "world"


def test_the_stop_completing_first_wins() -> None:
    emitted, matched = run(StopStringMatcher(["zzz", "b"]), ["a b zzz"])
    assert (emitted, matched) == (["a "], "b")
    # "bc" is complete before "abcd" is, whatever the chunking.
    assert run(StopStringMatcher(["abcd", "bc"]), ["xabcd"]) == (["xa"], "bc")
    assert run(StopStringMatcher(["abcd", "bc"]), ["xab", "cd"]) == (["x", "a"], "bc")


def test_overlapping_prefixes_hold_from_the_earliest_candidate() -> None:
    matcher = StopStringMatcher(["abcd", "cde"])
    assert matcher.feed("xxabc") == ("xx", None)  # "abc" may become "abcd", "c" may become "cde"
    assert matcher.feed("de") == ("", "abcd")
    matcher = StopStringMatcher(["abcd", "cde"])
    assert matcher.feed("xxabc") == ("xx", None)
    assert matcher.feed("x") == ("abcx", None)


def test_unchecked_text_within_min_tokens_is_not_matched() -> None:
    matcher = StopStringMatcher(["stop"])
    assert matcher.feed("stop now", check=False) == ("stop now", None)
    assert matcher.feed(" then stop", check=True) == (" then ", "stop")


def test_multi_character_unicode_stop() -> None:
    emitted, matched = run(StopStringMatcher(["🎉!"]), ["party 🎉", "! yes"])
    assert "".join(emitted) == "party "
    assert matched == "🎉!"


@pytest.mark.parametrize("seed", range(200))
def test_random_chunking_matches_a_whole_text_search(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab c"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    include = rng.random() < 0.5
    # Split the text at random points, as token boundaries would.
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 10))))
    chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]

    emitted, matched = run(StopStringMatcher(stops, include), chunks)

    # The stop completing first wins, then the one starting first, then the first listed.
    hits = [(text.find(s) + len(s), text.find(s), i, s) for i, s in enumerate(stops) if s in text]
    if not hits:
        assert matched is None and "".join(emitted) == text
        return
    _, start, _, stop = min(hits)
    assert matched == stop
    assert "".join(emitted) == text[:start + len(stop) if include else start]
