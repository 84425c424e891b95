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

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        """A chain continuing the most recent earlier match of the longest matching suffix."""
        count = min(max_tokens, self.num_draft_tokens)
        if count <= 0:
            return Draft.empty()
        ids = torch.tensor(context, dtype=torch.long)  # [len]
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(context) <= n:
                continue
            # Every n-gram that ends before the last token, so each has a continuation to copy.
            windows = ids[:-1].unfold(0, n, 1)  # [len - n, n]
            starts = (windows == ids[-n:]).all(dim=1).nonzero()  # [matches, 1]
            if len(starts):
                copy_from = int(starts[-1]) + n
                return Draft.chain(context[copy_from : copy_from + count])
        return Draft.empty()

    def candidates(self, context: list[int], k: int) -> list[tuple[int, float]]:
        """The tokens that followed earlier matches of the longest matching suffix, ranked by how
        often (ties: most recent first), with their frequencies as probabilities."""
        ids = torch.tensor(context, dtype=torch.long)  # [len]
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(context) <= n:
                continue
            windows = ids[:-1].unfold(0, n, 1)  # [len - n, n]
            starts = (windows == ids[-n:]).all(dim=1).nonzero().flatten()  # [matches]
            if len(starts):
                following = ids[starts + n].flip(0).tolist()  # most recent first
                counts: dict[int, int] = {}
                for token in following:
                    counts[token] = counts.get(token, 0) + 1
                ranked = sorted(counts.items(), key=lambda item: -item[1])[:k]
                return [(token, count / len(following)) for token, count in ranked]
        return []

    def update(self, context: list[int], num_accepted: int) -> None:
        """Nothing to learn: the context itself is the table."""
