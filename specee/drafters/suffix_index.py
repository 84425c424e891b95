"""Where every short n-gram of the committed text occurred, so prompt lookup finds its matches
in a dictionary lookup instead of rescanning a long context (a scan of 1,000 tokens costs
~0.2 ms, and a draft tree asks once per node)."""
from __future__ import annotations

import torch

# An unindexed tail longer than this is scanned with one vectorised comparison instead of a loop.
VECTOR_SCAN_FROM = 64


class SuffixIndex:
    """n-grams (n in 1..max_n) of a growing token list, each mapped to the positions that
    followed it, oldest first. Only committed text is indexed; a context that merely starts
    with it (committed text plus a hypothetical draft path) is matched by scanning the rest."""

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.tokens: list[int] = []
        self._follows: dict[tuple[int, ...], list[int]] = {}
        self._extended_by: list[int] | None = None  # the latest list `covered` found extending the text

    def reset(self, tokens: list[int]) -> None:
        """Index `tokens` afresh: each n's n-grams in one loop over zipped views of the text (half
        the time of appending a long prompt token by token; the same positions, oldest first)."""
        self.tokens = list(tokens)
        self._extended_by = None
        follows: dict[tuple[int, ...], list[int]] = {}
        for n in range(1, self.max_n + 1):
            for end, key in enumerate(zip(*(self.tokens[k:] for k in range(n))), start=n):
                follows.setdefault(key, []).append(end)
        self._follows = follows

    def extend(self, context: list[int]) -> None:
        """Index `context`, which must start with the text indexed so far (else it is re-indexed)."""
        if self.covered(context) == 0 and self.tokens:
            self.reset([])
        for token in context[len(self.tokens) :]:
            self.append(token)

    def append(self, token: int) -> None:
        """Index one more token of the text."""
        tokens, follows = self.tokens, self._follows
        tokens.append(token)
        end = len(tokens)
        for n in range(1, min(self.max_n, end) + 1):
            follows.setdefault(tuple(tokens[end - n :]), []).append(end)

    def covered(self, context: list[int]) -> int:
        """How many leading tokens of `context` are indexed: all indexed ones, or 0 if it differs."""
        m = len(self.tokens)
        # A list found to extend the text is trusted to grow only at its end, as a generation's
        # tokens do: comparing a long text on every call costs a share of a pass.
        if context is self.tokens or (context is self._extended_by and len(context) >= m):
            return m
        if len(context) >= m and context[:m] == self.tokens:
            self._extended_by = context
            return m
        return 0

    def follows(self, context: list[int], n: int, covered: int | None = None) -> list[int]:
        """Positions after every earlier occurrence of the last `n` tokens of `context`, oldest first.

        An occurrence must end before the last token, so each has a continuation to copy.
        `covered` is `self.covered(context)` when the caller already has it (a lookup per n
        would otherwise compare the whole context each time)."""
        m = self.covered(context) if covered is None else covered
        suffix = context[-n:]
        # Indexed occurrences; the one ending at the last token (the suffix itself) is excluded.
        listed = self._follows.get(tuple(suffix), []) if m else []
        # Positions grow as they are indexed, and none passes the indexed text: only the last can
        # be the suffix's own end.
        found = listed[:-1] if listed and listed[-1] >= len(context) else listed[:]
        first_start = max(0, m - n + 1)  # occurrences not wholly inside the indexed text
        last_start = len(context) - n - 1
        if last_start - first_start >= VECTOR_SCAN_FROM:
            ids = torch.tensor(context[first_start : len(context) - 1], dtype=torch.long)
            starts = (ids.unfold(0, n, 1) == torch.tensor(suffix)).all(dim=1).nonzero().flatten()
            return found + (starts + first_start + n).tolist()
        return found + [s + n for s in range(first_start, last_start + 1) if context[s : s + n] == suffix]
