"""Prompt lookup: draft by copying what followed the last occurrence of the current n-gram.

Free and strong wherever the output repeats its input: summaries, code edits, retrieval answers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specee.drafters.base import Draft


@dataclass
class PromptLookup:
    max_ngram: int = 3
    min_ngram: int = 1
    num_draft_tokens: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}"
            )

    def match(self, context: list[int]) -> tuple[int, list[int]]:
        """(n, where each earlier occurrence of the last n tokens continues), for the longest n in
        max_ngram..min_ngram that occurred before, oldest first; (0, []) when none did."""
        ids = torch.tensor(context, dtype=torch.long)  # [len]
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(context) <= n:
                continue
            # Every n-gram that ends before the last token, so each has a continuation to copy.
            windows = ids[:-1].unfold(0, n, 1)  # [len - n, n]
            starts = (windows == ids[-n:]).all(dim=1).nonzero().flatten()  # [matches]
            if len(starts):
                return n, (starts + n).tolist()
        return 0, []

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        """A chain continuing the most recent earlier match of the longest matching suffix."""
        return self.chain(context, self.match(context)[1], max_tokens)

    def chain(self, context: list[int], follows: list[int], max_tokens: int) -> Draft:
        """The draft copied from after the latest of `follows` (positions from `match`)."""
        count = min(max_tokens, self.num_draft_tokens)
        if count <= 0 or not follows:
            return Draft.empty()
        return Draft.chain(context[follows[-1] : follows[-1] + count])

    def candidates(self, context: list[int], k: int) -> list[tuple[int, float]]:
        """The tokens that followed earlier matches of the longest matching suffix, ranked by how
        often (ties: most recent first), with their frequencies as probabilities."""
        return ranked_continuations(context, self.match(context)[1], k)

    def update(self, context: list[int], num_accepted: int) -> None:
        """Nothing to learn: the context itself is the table."""


def ranked_continuations(context: list[int], follows: list[int], k: int) -> list[tuple[int, float]]:
    """The k most frequent tokens at positions `follows` (ties: latest first), with frequencies."""
    counts: dict[int, int] = {}
    for position in reversed(follows):
        counts[context[position]] = counts.get(context[position], 0) + 1
    ranked = sorted(counts.items(), key=lambda item: -item[1])[:k]  # stable: keeps latest-first ties
    return [(token, count / len(follows)) for token, count in ranked]
