"""Prompt lookup: draft by copying what followed the last occurrence of the current n-gram.

Free and strong wherever the output repeats its input: summaries, code edits, retrieval answers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..verification.draft import Draft
from .base import Proposer
from .copy_reliability import MAX_MATCH, CopyReliability
from .registry import Drafting, SpecMethod, register
from .suffix_index import SuffixIndex

# A match's length is read off this many of its latest occurrences (the longest agreement wins).
RECENT_OCCURRENCES = 4


@dataclass
class PromptLookup(Proposer):
    drafts_trees = True
    max_ngram: int = 3
    min_ngram: int = 1
    num_draft_tokens: int = 8
    index: SuffixIndex = field(init=False, repr=False)
    reliability: CopyReliability = field(init=False, repr=False)
    _scored: int | None = field(init=False, default=None, repr=False)  # positions already scored
    # The match of the indexed text itself, which `update` scores right after `propose` asked for it.
    _whole: tuple[int, tuple[int, list[int]]] | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}"
            )
        self.index = SuffixIndex(self.max_ngram)
        self.reliability = CopyReliability()

    def reset(self, prompt: list[int], sampler=None) -> None:
        """Start a generation: index the prompt and forget what earlier generations taught."""
        self.index.reset(prompt)
        self.reliability.reset()
        self._scored = len(prompt)
        self._whole = None

    def match(self, context: list[int]) -> tuple[int, list[int]]:
        """(n, where each earlier occurrence of the last n tokens continues), for the longest n in
        max_ngram..min_ngram that occurred before, oldest first; (0, []) when none did."""
        covered = self.index.covered(context)
        whole = covered == len(context)  # the context is the indexed text: its match is the index's
        if whole and self._whole is not None and self._whole[0] == covered:
            return self._whole[1]
        found = 0, []
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(context) > n:
                follows = self.index.follows(context, n, covered)
                if follows:
                    found = n, follows
                    break
        if whole:
            self._whole = covered, found
        return found

    def match_length(self, context: list[int], follows: list[int], n: int) -> int:
        """How many tokens before the latest few occurrences agree with the end of `context`,
        counting the n matched ones (at most MAX_MATCH): longer agreement, likelier copy."""
        best = n
        for follow in follows[-RECENT_OCCURRENCES:]:
            length = n
            while length < MAX_MATCH and follow - length > 0 and context[follow - length - 1] == context[-length - 1]:
                length += 1
            best = max(best, length)
        return best

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        """A chain continuing the most recent earlier match of the longest matching suffix."""
        return self.chain(context, self.match(context)[1], max_tokens)

    def chain(self, context: list[int], follows: list[int], max_tokens: int) -> Draft:
        """The draft copied from after the latest of `follows` (positions from `match`)."""
        count = min(max_tokens, self.num_draft_tokens)
        if count <= 0 or not follows:
            return Draft.empty()
        return Draft.chain(context[follows[-1] : follows[-1] + count])

    def copies(self, context: list[int], k: int) -> tuple[float, list[tuple[int, float]]]:
        """(how likely copying is right here, the k tokens that followed earlier matches of the
        longest matching suffix ranked by how often, with their shares); (0, []) without a match."""
        rate, follows = self.reliable_match(context)
        return rate, ranked_continuations(context, follows, k)

    def reliable_chain(self, context: list[int], max_tokens: int) -> tuple[float, list[int]]:
        """(how likely copying is right here, the chain `propose` would draft); (0, []) without a match."""
        rate, follows = self.reliable_match(context)
        return rate, self.chain(context, follows, max_tokens).tokens

    def reliable_match(self, context: list[int]) -> tuple[float, list[int]]:
        """(how likely copying is right here, the positions from `match`); (0, []) without a match."""
        n, follows = self.match(context)
        if not n:
            return 0.0, []
        return self.reliability.rate(self.match_length(context, follows, n)), follows

    def candidates(self, context: list[int], k: int) -> list[tuple[int, float]]:
        """The copied continuations, each with its share times the copy's reliability."""
        reliability, ranked = self.copies(context, k)
        return [(token, share * reliability) for token, share in ranked]

    def update(self, context: list[int], num_accepted: int, score: bool = True) -> None:
        """Score the copy this drafter would have offered before each newly committed token (how
        reliable copies are in this text), then index the new tokens; `score` False only indexes
        them (a caller resting its drafters spends nothing on what it will not ask)."""
        if self._scored is None:  # never reset: start with the tokens of this step
            self._scored = max(0, len(context) - num_accepted - 1)
        if self.index.covered(context) != self._scored:  # a text not indexed (never reset, or another)
            self.index.reset(context[: self._scored])
        text = self.index.tokens  # the text before each new token in turn, indexed token by token
        for token in context[self._scored :]:
            if score:
                n, follows = self.match(text)
                if n:
                    best = ranked_continuations(text, follows, 1)[0][0]
                    self.reliability.record(self.match_length(text, follows, n), best == token)
            self.index.append(token)
            self._whole = None
        self._scored = len(context)


def ranked_continuations(context: list[int], follows: list[int], k: int) -> list[tuple[int, float]]:
    """The k most frequent tokens at positions `follows` (ties: latest first), with frequencies."""
    if len(follows) == 1:  # one occurrence: most matches in a text of a few hundred tokens
        return [(context[follows[0]], 1.0)][:k]
    counts: dict[int, int] = {}
    for position in reversed(follows):
        counts[context[position]] = counts.get(context[position], 0) + 1
    ranked = sorted(counts.items(), key=lambda item: -item[1])[:k]  # stable: keeps latest-first ties
    return [(token, count / len(follows)) for token, count in ranked]


def _prompt_lookup_method(config, artifacts) -> Drafting:
    return Drafting(lambda: PromptLookup(num_draft_tokens=config.num_draft_tokens))


register(SpecMethod("prompt-lookup", _prompt_lookup_method,
                    bench={"prompt-lookup": {}, "prompt-lookup-tree": {"tree": "auto"}}))
