import pytest

from specee.drafters.copy_reliability import MAX_MATCH, PRIOR_HIT_RATE, PRIOR_WEIGHT, CopyReliability
from specee.drafters.prompt_lookup import PromptLookup


def test_rates_start_at_the_prior_and_follow_what_is_observed():
    reliability = CopyReliability()
    assert reliability.rate(2) == PRIOR_HIT_RATE[1]
    for _ in range(24):
        reliability.record(2, hit=False)
    assert reliability.rate(2) == pytest.approx(PRIOR_HIT_RATE[1] * PRIOR_WEIGHT / (PRIOR_WEIGHT + 24))
    assert reliability.rate(1) == PRIOR_HIT_RATE[0]  # other lengths are untouched
    reliability.record(MAX_MATCH + 5, hit=True)  # longer matches count as the longest
    assert reliability.rate(MAX_MATCH + 5) == reliability.rate(MAX_MATCH) > PRIOR_HIT_RATE[-1]
    reliability.reset()
    assert reliability.rate(2) == PRIOR_HIT_RATE[1]


def test_match_length_counts_how_far_back_the_latest_occurrences_agree():
    lookup = PromptLookup(max_ngram=2)
    context = [1, 2, 3, 4, 9, 8, 2, 3, 4, 9]  # [4, 9] matched; before it 3, 2 agree too, then 8 vs 1
    n, follows = lookup.match(context)
    assert (n, follows) == (2, [5])
    assert lookup.match_length(context, follows, n) == 4


def test_a_generation_whose_copies_keep_failing_lowers_their_probability():
    lookup = PromptLookup(num_draft_tokens=4)
    prompt = [1, 2, 3, 4, 5, 6]
    lookup.reset(prompt)
    context = list(prompt)
    before = lookup.candidates(context + [1], 1)  # [1] matched: copy 2
    # Each committed token follows a 1-token match whose copy was wrong.
    for token in (1, 3, 2, 4, 3, 5):
        context.append(token)
        lookup.update(context, 0)
    assert lookup.reliability.trials[0] >= 5 and lookup.reliability.hits[0] == 0
    after = lookup.candidates(prompt + [1], 1)  # the same match as before, now trusted less
    assert after[0][0] == before[0][0] == 2
    assert after[0][1] == pytest.approx(lookup.reliability.rate(1)) and after[0][1] < before[0][1]
    lookup.reset(prompt)  # a new generation starts from the prior again
    assert lookup.candidates(prompt + [1], 1) == before
