"""Stop strings over streamed text.

Stop strings are text, so they are the gateway's job (token-id stops are the
scheduler's). A stop string may span several tokens and several streaming steps, so
the tail of the text that could still be the start of a stop string is held back
until the next text proves it is not. The work per call depends only on the new text
and the stop strings' lengths, never on how much text came before.
"""

from __future__ import annotations


class StopStringMatcher:
    """Finds the first stop string in one sequence's text as it streams in."""

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = [s for s in stop if s]
        self._include_stop_str = include_stop_str_in_output
        self._held_back = ""  # text that might be the start of a stop string

    def feed(self, text: str, check: bool = True) -> tuple[str, str | None]:
        """Add new text; return (text that is safe to emit now, matched stop string).

        On a match the returned text ends where the stop string starts (or after it
        with include_stop_str_in_output); the caller must then finish the sequence.
        `check=False` (still inside min_tokens) passes text through unchecked.
        """
        if not self._stops:
            return text, None
        buffer = self._held_back + text
        self._held_back = ""
        if not check:
            return buffer, None
        match = self._first_match(buffer)
        if match is not None:
            start, stop = match
            return buffer[:start + len(stop) if self._include_stop_str else start], stop
        hold_from = self._possible_stop_start(buffer)
        self._held_back = buffer[hold_from:]
        return buffer[:hold_from], None

    def flush(self) -> str:
        """The sequence ended without a match: release the held-back text."""
        text, self._held_back = self._held_back, ""
        return text

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        # The held-back part contained no complete stop string, so any match in the
        # buffer is new. The one that completes first wins (then the one starting
        # first), exactly as if the text had arrived one character at a time, so the
        # result does not depend on how the text was split into tokens.
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = buffer.find(stop)
            if start != -1:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[1], best[2])

    def _possible_stop_start(self, buffer: str) -> int:
        """Index where the longest suffix of `buffer` that is a proper prefix of some
        stop string begins (len(buffer) if there is none)."""
        earliest = len(buffer)
        for stop in self._stops:
            # Only the last len(stop) - 1 characters can begin an unfinished `stop`.
            i = buffer.find(stop[0], max(0, len(buffer) - len(stop) + 1))
            while i != -1 and i < earliest:
                if stop.startswith(buffer[i:]):
                    earliest = i
                    break
                i = buffer.find(stop[0], i + 1)
        return earliest
