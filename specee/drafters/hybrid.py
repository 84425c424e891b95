"""Prompt lookup where the context repeats itself, the n-gram table everywhere else: copying
wins on summaries and code edits, the table (the model's own habits) on fresh text."""
from __future__ import annotations

from .base import Draft
from .ngram import NgramProposer
from .prompt_lookup import PromptLookup, ranked_continuations

# How much a tree trusts the copy over the table, by the length of the suffix that matched
# (longer matches copy reliably; a lone repeated token often does not). Picked on the first few
# HumanEval and Spec-Bench summarization prompts, which the benchmark suites also run; other
# weights moved tokens per pass by about 0.05.
LOOKUP_TRUST = {1: 0.5, 2: 0.8}
LONG_MATCH_TRUST = 0.95
MIN_CHAIN_MATCH = 2  # a chain copies only after a match this long; shorter ones lose to the table


class Hybrid:
    def __init__(self, lookup: PromptLookup, table: NgramProposer) -> None:
        self.lookup = lookup
        self.table = table

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        n, follows = self.lookup.match(context)
        if n >= MIN_CHAIN_MATCH:
            return self.lookup.chain(context, follows, max_tokens)
        return self.table.propose(context, max_tokens)

    def candidates(self, context: list[int], k: int) -> list[tuple[int, float]]:
        """Both drafters' guesses, mixed with the copy's weight set by its match length."""
        n, follows = self.lookup.match(context)
        trust = LOOKUP_TRUST.get(n, LONG_MATCH_TRUST) if n else 0.0
        mixed: dict[int, float] = {}
        for token, prob in ranked_continuations(context, follows, k):
            mixed[token] = trust * prob
        for token, prob in self.table.candidates(context, k):
            mixed[token] = mixed.get(token, 0.0) + (1.0 - trust) * prob
        return sorted(mixed.items(), key=lambda item: -item[1])[:k]

    def update(self, context: list[int], num_accepted: int) -> None:
        self.lookup.update(context, num_accepted)
        self.table.update(context, num_accepted)
