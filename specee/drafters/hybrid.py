"""Prompt lookup where the context repeats itself, the n-gram table everywhere else: copying
wins on summaries and code edits, the table (the model's own habits) on fresh text."""
from __future__ import annotations

from ..verification.draft import Draft
from .base import Proposer
from .ngram import NgramProposer
from .prompt_lookup import PromptLookup
from .registry import Drafting, SpecMethod, register


class Hybrid(Proposer):
    drafts_trees = True

    def __init__(self, lookup: PromptLookup, table: NgramProposer, min_copy_match: int = 1) -> None:
        self.lookup = lookup
        self.table = table
        self.min_copy_match = min_copy_match  # a chain copies only after a match this long

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        n, follows = self.lookup.match(context)
        if n >= self.min_copy_match:
            return self.lookup.chain(context, follows, max_tokens)
        return self.table.propose(context, max_tokens)

    def reset(self, prompt: list[int], sampler=None) -> None:
        self.lookup.reset(prompt)

    def candidates(self, context: list[int], k: int) -> list[tuple[int, float]]:
        """Both drafters' guesses mixed: the copy is right with its measured reliability, and
        otherwise the table's distribution applies."""
        reliability, copies = self.lookup.copies(context, k)
        mixed = {token: reliability * share for token, share in copies}
        for token, prob in self.table.candidates(context, k):
            mixed[token] = mixed.get(token, 0.0) + (1.0 - reliability) * prob
        return sorted(mixed.items(), key=lambda item: -item[1])[:k]

    def update(self, context: list[int], num_accepted: int) -> None:
        self.lookup.update(context, num_accepted)
        self.table.update(context, num_accepted)


def _hybrid_method(config, artifacts) -> Drafting:
    table, n = artifacts.load("ngram", config.ngram_model), config.num_draft_tokens
    return Drafting(lambda: Hybrid(PromptLookup(num_draft_tokens=n), NgramProposer(table, n, config.confidence_threshold),
                                   config.min_copy_match))


register(SpecMethod("hybrid", _hybrid_method, scored=True, bench={"hybrid": {}, "hybrid-tree": {"tree": "auto"}}))
