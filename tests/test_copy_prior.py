"""`specee train copy-prior`: hit counts become a non-decreasing prior; prompts come per category,
after the reported ones."""
import json

import pytest

from specee.drafters.copy_reliability import MAX_MATCH
from specee.train.copy_prior import MIN_TRIALS, copy_hit_counts, prior_rates
from specee.train.ngram import dataset_prompts


def test_rates_are_rounded_non_decreasing_and_thin_lengths_inherit():
    hits = [30, 45, 10, 0] + [0] * (MAX_MATCH - 4)
    trials = [100, 100, 12, 50] + [0] * (MAX_MATCH - 4)
    rates = prior_rates(hits, trials)
    assert rates[:2] == (0.3, 0.45)
    assert 12 < MIN_TRIALS and rates[2] == 0.45  # too few trials: the shorter length's rate
    assert rates[3] == 0.45  # measured 0.0, but a longer match is never a worse sign
    assert len(rates) == MAX_MATCH and list(rates) == sorted(rates)


def test_prompts_skip_the_reported_ones_in_every_category(tmp_path):
    lines = [{"question_id": i, "category": cat, "turns": [f"{cat} {i}"]}
             for cat in ("a", "b") for i in range(6)]
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert dataset_prompts([str(path)], skip_first=4, limit=None) == ["a 4", "a 5", "b 4", "b 5"]
    assert dataset_prompts([str(path)], skip_first=1, limit=2) == ["a 1", "a 2", "b 1", "b 2"]


@pytest.mark.slow
def test_hit_counts_score_every_answer_token_after_a_match(default_engine):
    prompt = "Repeat exactly: the blue whale is the largest animal that has ever lived."
    hits, trials = copy_hit_counts(default_engine, [prompt], max_tokens=24)
    answer = default_engine.generate(prompt, max_tokens=24).token_ids
    assert 0 < sum(trials) <= len(answer)
    assert 0 < sum(hits) <= sum(trials)  # the copy of the sentence is mostly right
    assert sum(hits) / sum(trials) > 0.5
