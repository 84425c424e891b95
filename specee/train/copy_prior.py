"""`specee train copy-prior`: measure how often prompt lookup's copy is the next token, by how long
the copied text matched, on the model's own answers. The result is the prior that
`drafters/copy_reliability.py` starts every generation from."""
from __future__ import annotations

import sys

from tqdm import tqdm

from ..drafters.copy_reliability import MAX_MATCH
from ..drafters.prompt_lookup import PromptLookup
from ..engine import Engine

MIN_TRIALS = 20  # a match length seen fewer times than this takes the shorter length's rate


def copy_hit_counts(engine: Engine, prompts: list[str], max_tokens: int) -> tuple[list[int], list[int]]:
    """(hits, trials) per match length 1..MAX_MATCH over the model's greedy answers (to EOS):
    each answer token is scored against the copy prompt lookup would have offered before it."""
    hits, trials = [0] * MAX_MATCH, [0] * MAX_MATCH
    for text in tqdm(prompts, desc="answers", unit="prompt", file=sys.stderr):
        ids = engine.encode(text)
        answer = engine.generate(ids, max_tokens=max_tokens, spec_method="prompt-lookup").token_ids
        lookup = PromptLookup()
        lookup.reset(ids)
        lookup.update(ids + answer, 0)  # scores every answer token, as a generation does online
        hits = [a + b for a, b in zip(hits, lookup.reliability.hits)]
        trials = [a + b for a, b in zip(trials, lookup.reliability.trials)]
    return hits, trials


def prior_rates(hits: list[int], trials: list[int]) -> tuple[float, ...]:
    """Hit rates rounded to 0.05 and made non-decreasing in the match length (a longer match is
    never a worse sign); thinly observed lengths inherit the shorter length's rate."""
    rates: list[float] = []
    for hit, trial in zip(hits, trials):
        measured = hit / trial if trial >= MIN_TRIALS else (rates[-1] if rates else 0.0)
        rates.append(max([round(measured * 20) / 20, *rates[-1:]]))
    return tuple(rates)


def measure_copy_prior(engine: Engine, prompts: list[str], max_tokens: int) -> tuple[float, ...]:
    hits, trials = copy_hit_counts(engine, prompts, max_tokens)
    for length, (hit, trial) in enumerate(zip(hits, trials), start=1):
        print(f"match length {length}{'+' if length == MAX_MATCH else ''}: {hit}/{trial} copies right", file=sys.stderr)
    rates = prior_rates(hits, trials)
    print(f"PRIOR_HIT_RATE = {rates}")
    return rates
