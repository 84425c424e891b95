"""Incremental detokenization with stop strings.

Text is released only when it is final: not ending inside a multi-byte character, and not
possibly the start of a stop string (the stop string itself is never shown).
"""
from __future__ import annotations

from .tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: list[str] | tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # all decoded text so far (cut at a stop string once one is found)
        self.stopped = False
        self._emitted = 0
        # Decoding ids[prefix:] and subtracting ids[prefix:read] keeps each step short while
        # still letting tokenizers that merge across tokens (spaces, bytes) decode correctly.
        self._prefix = 0
        self._read = 0

    def add(self, ids: list[int]) -> str:
        """Append token ids; returns the newly final text (nothing once a stop string is hit)."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        before = self.tokenizer.decode(self.ids[self._prefix : self._read])
        after = self.tokenizer.decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
        self._check_stop()
        return self._release(len(self.text) - (0 if self.stopped else self._partial_stop()))

    def finish(self) -> str:
        """Everything not yet released (at the end of generation)."""
        return self._release(len(self.text))

    def _partial_stop(self) -> int:
        """The length of the longest end of the unreleased text that begins a stop string: only
        that much could still turn out to be one, so only that much is held back."""
        pending = self.text[self._emitted :]
        longest = max((len(stop) for stop in self.stop), default=0)
        firsts = {stop[0] for stop in self.stop}
        # The earliest start is the longest end; a whole stop string would have been found already.
        for start in range(max(0, len(pending) - longest + 1), len(pending)):
            if pending[start] in firsts and any(stop.startswith(pending[start:]) for stop in self.stop):
                return len(pending) - start
        return 0

    def _check_stop(self) -> None:
        if self.stopped or not self.stop:
            return
        longest = max(len(s) for s in self.stop)
        window_start = max(0, self._emitted - longest)
        hits = [i for s in self.stop if (i := self.text.find(s, window_start)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _release(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self.text[self._emitted : upto]
        self._emitted = upto
        return out
