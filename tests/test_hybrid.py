import pytest

from specee.verification.draft import Draft
from specee.drafters.copy_reliability import PRIOR_HIT_RATE
from specee.drafters.hybrid import Hybrid
from specee.drafters.prompt_lookup import PromptLookup


class FixedTable:
    """Stands in for the n-gram table: always the same guesses."""

    def __init__(self, candidates: list[tuple[int, float]]) -> None:
        self._candidates = candidates

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        return Draft.chain([self._candidates[0][0]] * max_tokens)

    def candidates(self, context: list[int], k: int) -> list[tuple[int, float]]:
        return self._candidates[:k]

    def update(self, context: list[int], num_accepted: int) -> None:
        pass


TABLE = FixedTable([(40, 0.6), (41, 0.3)])


def test_chain_copies_only_after_a_match_of_min_copy_match_tokens():
    hybrid = Hybrid(PromptLookup(num_draft_tokens=3), TABLE, min_copy_match=2)
    assert hybrid.propose([1, 2, 3, 4, 5, 1, 2], 3).tokens == [3, 4, 5]  # [1, 2] matched
    assert hybrid.propose([1, 2, 3, 4, 5, 9, 2], 3).tokens == [40, 40, 40]  # only [2] matched
    assert hybrid.propose([1, 2, 3], 2).tokens == [40, 40]  # nothing matched


@pytest.mark.parametrize("context, match_length", [([7, 1, 2, 3, 9, 2], 1), ([7, 1, 2, 3, 9, 1, 2], 2)])
def test_tree_candidates_mix_copy_and_table_by_match_length(context, match_length):
    trust = PRIOR_HIT_RATE[match_length - 1]  # nothing observed yet: the prior reliability
    candidates = dict(Hybrid(PromptLookup(), TABLE).candidates(context, 3))
    assert candidates == pytest.approx({3: trust, 40: (1 - trust) * 0.6, 41: (1 - trust) * 0.3})


def test_tree_candidates_are_the_table_alone_without_a_match():
    assert Hybrid(PromptLookup(), TABLE).candidates([1, 2, 3], 2) == TABLE.candidates([], 2)


def test_a_token_both_offer_adds_up():
    table = FixedTable([(3, 0.5), (40, 0.5)])
    candidates = Hybrid(PromptLookup(), table).candidates([7, 1, 2, 3, 9, 2], 2)
    trust = PRIOR_HIT_RATE[0]
    assert candidates[0] == (3, pytest.approx(trust + (1 - trust) * 0.5))


def test_by_default_any_match_is_copied():
    context = [1, 2, 3, 4, 5, 9, 2]  # only [2] matched
    assert Hybrid(PromptLookup(num_draft_tokens=3), TABLE).propose(context, 3).tokens == [3, 4, 5]
    assert Hybrid(PromptLookup(num_draft_tokens=3), TABLE).propose([1, 2, 3], 2).tokens == [40, 40]
