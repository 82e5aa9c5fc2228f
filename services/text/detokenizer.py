"""Incremental detokenization (vLLM's prefix_offset / read_offset algorithm).

A token is often not a whole character: byte-level BPE splits an emoji or a CJK
character over several tokens, and decoding half of one yields U+FFFD. We therefore
decode a small sliding window of tokens twice, once without and once with the unread
tokens, and emit the difference only once it no longer ends in U+FFFD. The window is
re-anchored after every emission, so the work per token stays constant however long
the output grows.

At the end of the sequence (`flush`) the text still held back is released, except a
character cut short: an output stopped by max_tokens (or a stop token, or an abort) in the
middle of a multi-byte character does not end in the U+FFFD its incomplete bytes decode
to. vLLM never emits such a tail either (`detokenize_incrementally` holds it back and
nothing releases it). Unlike vLLM, a U+FFFD the model generated as a whole character
(the bytes EF BF BD) is kept: the decision is made on the tokens' raw bytes.

Decoding the window (rather than single tokens) also keeps tokenizers that drop a
word's leading space at the start of a decode (SentencePiece "▁") correct: the first
token of the window loses its space in both decodes alike, and only the difference
is emitted.
"""

from __future__ import annotations

import codecs
from typing import Protocol

# How many prompt tokens seed the window, as in vLLM: enough context for the first
# output token to decode with the right leading space.
INITIAL_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"
# No real character spans this many tokens; beyond it the window is re-anchored anyway.
MAX_UNREAD_TOKENS = 16


class Decoder(Protocol):
    """The slice of a HF tokenizer this module needs."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


def ends_mid_character(data: bytes) -> bool:
    """Whether `data` ends in the first bytes of a multi-byte UTF-8 character (a sequence that
    more bytes could still complete), as opposed to whole characters or invalid bytes."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data, final=False)
    return bool(decoder.getstate()[0])  # the bytes it holds back for the next call


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text, one token at a time."""

    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # `_window` holds only the tokens from prefix_offset on; older ones are dropped.
        self._window: list[int] = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        # Window-relative offsets: [0, read_offset) was already emitted as text (it is
        # decoded only as context); [read_offset, len) is still unread.
        self._read_offset = len(self._window)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ('' while a character is partial)."""
        self._window.append(token_id)
        prefix_text = self._decode(self._window[:self._read_offset])
        full_text = self._decode(self._window)
        waiting = len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR)
        if waiting and len(self._window) - self._read_offset < MAX_UNREAD_TOKENS:
            # A partial UTF-8 sequence (or a skipped special token): wait for more tokens.
            return ""
        # (Past MAX_UNREAD_TOKENS we emit whatever there is, so the window stays bounded
        # even for a long run of skipped special tokens or invalid bytes.)
        new_text = full_text[len(prefix_text):]
        # The just-read tokens become the context for the next ones.
        del self._window[:self._read_offset]
        self._read_offset = len(self._window)
        return new_text

    def flush(self) -> str:
        """At the end of the sequence, release text still held back, less a trailing
        character cut short (its U+FFFD); a whole U+FFFD the model generated stays."""
        if self._read_offset == len(self._window):
            return ""
        unread = self._window[self._read_offset:]
        prefix_text = self._decode(self._window[:self._read_offset])
        new_text = self._decode(self._window)[len(prefix_text):]
        del self._window[:self._read_offset]
        self._read_offset = len(self._window)
        if new_text.endswith(REPLACEMENT_CHAR) and self._unread_ends_mid_character(unread):
            # A lossy decode turns an incomplete sequence at the end into exactly one U+FFFD.
            new_text = new_text[:-1]
        return new_text

    def _unread_ends_mid_character(self, token_ids: list[int]) -> bool:
        # Tokens the decode drops (skipped special tokens) add no bytes; the last
        # MAX_UNREAD_TOKENS tokens at most, so this stays cheap.
        data = b"".join(self._tokenizer.token_bytes(t) for t in token_ids if self._decode([t]))
        return ends_mid_character(data)
