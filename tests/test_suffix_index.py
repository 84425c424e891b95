import random

import pytest

from specee.drafters.suffix_index import VECTOR_SCAN_FROM, SuffixIndex


def scan(context: list[int], n: int) -> list[int]:
    """Every earlier occurrence of the last n tokens, by brute force."""
    suffix = context[-n:]
    return [s + n for s in range(len(context) - n) if context[s : s + n] == suffix]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("at_once", [False, True], ids=["grown", "at once"])
def test_lookups_equal_a_full_scan_for_committed_text_plus_a_draft_path(seed, at_once):
    rng = random.Random(seed)
    committed = [rng.randrange(4) for _ in range(rng.randrange(1, 200))]
    index = SuffixIndex(max_n=3)
    if at_once:  # a prompt, indexed whole
        index.reset(committed)
    else:  # grown in two steps, as during a generation
        index.reset(committed[:5])
        index.extend(committed)
    for _ in range(20):
        context = committed + [rng.randrange(4) for _ in range(rng.randrange(0, 10))]
        for n in range(1, min(3, len(context) - 1) + 1):
            assert index.follows(context, n) == scan(context, n)


def test_a_context_that_does_not_start_with_the_indexed_text_is_scanned_whole():
    index = SuffixIndex(max_n=2)
    index.reset([1, 2, 3, 1, 2])
    context = [9, 2, 3] * (VECTOR_SCAN_FROM // 2) + [2]  # long enough for the vectorised scan
    assert index.covered(context) == 0
    assert index.follows(context, 1) == scan(context, 1)
    index.extend(context)  # re-indexed from scratch
    assert index.covered(context) == len(context)
    assert index.follows(context + [3], 2) == scan(context + [3], 2)


def test_the_last_n_tokens_themselves_are_not_a_match():
    index = SuffixIndex(max_n=2)
    index.reset([5, 6, 7, 5, 6])
    assert index.follows([5, 6, 7, 5, 6], 2) == [2]
    assert index.follows([5, 6, 7, 5, 6], 1) == [2]
