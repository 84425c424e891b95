"""How often a copied continuation is really the next token, by how long the copied text matched.

A copy after a 1-token match is right about a third of the time, one after an 8-token match nine
times in ten, so a draft tree should branch after weak matches and stop where nodes are unlikely.
The rates start from a measurement and follow the current generation: a summary copies its
article more reliably than an essay copies its prompt.
"""
from __future__ import annotations

# Hit rate of the most frequent continuation, by match length (longer ones count as the longest),
# as `specee train copy-prior` measures it on the tuning slice (the default model's greedy answers
# to prompts 6-10 of every Spec-Bench category and of HumanEval; 5,722 scored tokens; command in
# BENCHMARKS.md), rounded to 0.05 and made non-decreasing.
PRIOR_HIT_RATE = (0.25, 0.45, 0.60, 0.70, 0.75, 0.80, 0.80, 0.90)
MAX_MATCH = len(PRIOR_HIT_RATE)
# The prior weighs as much as this many observed copies of the same match length.
PRIOR_WEIGHT = 8.0


class CopyReliability:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.hits = [0] * MAX_MATCH
        self.trials = [0] * MAX_MATCH

    def rate(self, match_length: int) -> float:
        """The probability that a copy after a match of this length is the next token."""
        i = min(match_length, MAX_MATCH) - 1
        return (PRIOR_HIT_RATE[i] * PRIOR_WEIGHT + self.hits[i]) / (PRIOR_WEIGHT + self.trials[i])

    def record(self, match_length: int, hit: bool) -> None:
        i = min(match_length, MAX_MATCH) - 1
        self.trials[i] += 1
        self.hits[i] += hit
