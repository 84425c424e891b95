"""Prompt lookup where the context repeats itself, the n-gram table everywhere else: copying
wins on summaries and code edits, the table (the model's own habits) on fresh text."""
from __future__ import annotations

from .base import Draft
from .ngram import NgramProposer
from .prompt_lookup import PromptLookup


class Hybrid:
    def __init__(self, lookup: PromptLookup, table: NgramProposer) -> None:
        self.lookup = lookup
        self.table = table

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        draft = self.lookup.propose(context, max_tokens)
        return draft if len(draft) else self.table.propose(context, max_tokens)

    def candidates(self, context: list[int], k: int) -> list[tuple[int, float]]:
        return self.lookup.candidates(context, k) or self.table.candidates(context, k)

    def update(self, context: list[int], num_accepted: int) -> None:
        self.lookup.update(context, num_accepted)
        self.table.update(context, num_accepted)
