import pytest

from specee.drafters.copy_reliability import PRIOR_HIT_RATE
from specee.drafters.prompt_lookup import PromptLookup


def test_copies_after_the_most_recent_match():
    context = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 8, 1, 2, 3]
    draft = PromptLookup(num_draft_tokens=3).propose(context, max_tokens=10)
    assert draft.tokens == [5, 6, 7]
    assert draft.parents == [-1, 0, 1]


def test_respects_max_tokens_and_the_end_of_the_context():
    context = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 8, 1, 2, 3]
    assert PromptLookup(num_draft_tokens=8).propose(context, max_tokens=2).tokens == [5, 6]
    # The only earlier match of [1, 2] is near the end: its continuation is cut by the context.
    assert PromptLookup(num_draft_tokens=8).propose([1, 2, 1, 2], max_tokens=8).tokens == [1, 2]


def test_backs_off_to_shorter_ngrams_down_to_min_ngram():
    context = [7, 8, 1, 2, 9, 3, 2]  # [9, 3, 2] and [3, 2] never occurred before; [2] did
    assert PromptLookup(num_draft_tokens=3).propose(context, 8).tokens == [9, 3, 2]
    assert len(PromptLookup(min_ngram=2, num_draft_tokens=3).propose(context, 8)) == 0


def test_prefers_the_longest_matching_ngram():
    # [5] last occurred before 8, but [4, 5] occurred before 6 earlier on.
    context = [4, 5, 6, 0, 5, 8, 4, 5]
    assert PromptLookup(num_draft_tokens=1).propose(context, 8).tokens == [6]


def test_empty_draft_when_nothing_matches():
    lookup = PromptLookup(num_draft_tokens=4)
    assert len(lookup.propose([1, 2, 3, 4], 4)) == 0
    assert len(lookup.propose([], 4)) == 0
    assert len(lookup.propose([1, 2, 1], 0)) == 0


def test_rejects_inverted_ngram_range():
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(max_ngram=1, min_ngram=2)


def test_finds_a_match_far_back_in_a_long_context():
    context = list(range(4000)) + [10, 11, 12]
    assert PromptLookup(num_draft_tokens=5).propose(context, 5).tokens == [13, 14, 15, 16, 17]


def test_candidates_rank_every_continuation_by_frequency_latest_first_on_ties():
    # [2] was followed by 5, 7, 5, 9: 5 twice, then the tie 9 (latest) before 7.
    context = [2, 5, 2, 7, 2, 5, 2, 9, 2]
    reliability = PRIOR_HIT_RATE[0]  # a 1-token match, nothing observed yet
    assert PromptLookup().candidates(context, 3) == [(5, 0.5 * reliability), (9, 0.25 * reliability), (7, 0.25 * reliability)]
    assert PromptLookup().match(context) == (1, [1, 3, 5, 7])


def test_an_unscored_update_indexes_the_new_tokens_without_scoring_their_copies():
    scored, unscored = PromptLookup(), PromptLookup()
    text = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    for lookup in (scored, unscored):
        lookup.reset(text[:4])
    scored.update(text, 0)
    unscored.update(text, 0, score=False)
    # Every new token after the first (whose [4] had not occurred before) followed a match, and was its copy.
    assert sum(scored.reliability.trials) == sum(scored.reliability.hits) == 5
    assert sum(unscored.reliability.trials) == 0
    # Both indexed every token: the copy after [1, 2] is the same.
    assert unscored.propose(text, 2).tokens == scored.propose(text, 2).tokens == [3, 4]
