"""The server-wide suffix cache: earlier requests' prompts and answers, looked up by the current
context's suffix; a bounded budget that evicts the oldest documents; and, through `auto`, drafts
that repeat an earlier answer, verified, so the output stays dense decoding's."""
import random

import pytest

from helpers import tiny_model
from specee.drafters.suffix_cache import KEY_TOKENS, MAX_MATCH, RECENT_OCCURRENCES, SuffixCache, hit_rate
from specee.engine import Engine
from specee.strategies.dense import Autoregressive


def brute_force(documents: list[list[int]], context: list[int], limit: int):
    """The reference lookup: among the latest RECENT_OCCURRENCES occurrences of the context's last
    KEY_TOKENS tokens in the held documents, the one whose earlier text agrees longest (ties: the
    latest), and what followed it in its document."""
    occurrences = [(d, p) for d, doc in enumerate(documents) for p in range(KEY_TOKENS, len(doc))
                   if doc[p - KEY_TOKENS : p] == context[-KEY_TOKENS:]]
    best = None
    for d, p in occurrences[-RECENT_OCCURRENCES:]:
        doc, length = documents[d], KEY_TOKENS
        while length < MAX_MATCH and p - length > 0 and length < len(context) and doc[p - length - 1] == context[-length - 1]:
            length += 1
        if best is None or length >= best[0]:
            best = (length, doc[p : p + limit])
    return best


@pytest.mark.parametrize("seed", range(6))
def test_lookups_equal_a_brute_force_search_of_the_documents_held_while_old_ones_are_evicted(seed):
    rng = random.Random(seed)
    budget = rng.choice([60, 150, 400])
    cache, added = SuffixCache(budget), []
    for _ in range(30):
        document = [rng.randrange(5) for _ in range(rng.randrange(1, 90))]
        cache.add(document)
        if len(document) > KEY_TOKENS:
            added.append(document[-budget:])
        held, total = [], 0  # the newest documents that fit the budget
        for doc in reversed(added):
            if total + len(doc) > budget:
                break
            held.insert(0, doc)
            total += len(doc)
        assert cache.held == total <= budget
        for _ in range(5):
            context = [rng.randrange(5) for _ in range(rng.randrange(1, 40))]
            limit = rng.randrange(1, 12)
            found = cache.lookup(context, limit)
            assert (None if found is None else tuple(found)) == brute_force(held, context, limit)


def test_the_longest_agreement_wins_and_a_continuation_stops_at_its_documents_end():
    cache = SuffixCache(1000)
    cache.add([1, 2, 3, 4, 5, 6, 7, 8, 9])
    cache.add([50, 2, 3, 4, 5, 60, 61])  # later, but agrees only on the key
    match = cache.lookup([0, 1, 2, 3, 4, 5], 10)
    assert match.length == 5 and match.continuation == [6, 7, 8, 9]  # its document ends at 9
    match = cache.lookup([9, 9, 2, 3, 4, 5], 10)  # equal agreement: the latest occurrence
    assert match.length == KEY_TOKENS and match.continuation == [60, 61]
    assert cache.lookup([70, 71, 72, 73], 10) is None  # nothing in common
    assert cache.lookup([3, 4, 5], 10) is None  # shorter than a key
    assert cache.stats.documents == 2 and cache.stats.hits == 2


def test_the_budget_evicts_the_oldest_documents_and_their_matches():
    cache = SuffixCache(20)
    first, second, third = list(range(100, 110)), list(range(200, 210)), list(range(300, 310))
    for document in (first, second, third):
        cache.add(document)
    assert cache.held == 20 and cache.stats.evicted == 1
    assert cache.lookup(first[:6], 4) is None  # evicted
    assert cache.lookup(second[:6], 4).continuation == second[6:10]
    assert cache.lookup(third[:5], 4).continuation == third[5:9]
    cache.clear()
    assert cache.held == 0 and cache.lookup(third[:5], 4) is None
    cache.add(first)
    assert cache.lookup(first[:5], 2).continuation == first[5:7]  # positions stay valid after a clear
    assert SuffixCache(0).enabled is False


def test_longer_matches_are_trusted_more():
    rates = [hit_rate(length) for length in range(KEY_TOKENS, MAX_MATCH + 8)]
    assert rates == sorted(rates) and 0 < rates[0] < rates[-1] < 1


@pytest.fixture
def engine(tiny_tokenizer):
    return Engine(tiny_model(seed=5, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=2), tiny_tokenizer)


class Lossy(Autoregressive):
    lossless = False


PROMPT = "Call the weather tool for Paris, then answer in one line."


def test_a_request_repeating_an_earlier_answer_drafts_it_from_the_cache_and_answers_as_dense(engine):
    first = engine.generate(PROMPT, max_tokens=48, ignore_eos=True)
    assert "suffix" not in first.stats.drafters  # nothing held yet
    assert engine.suffix_cache.stats.documents == 1
    again = engine.generate(PROMPT, max_tokens=48, ignore_eos=True)
    dense = engine.generate(PROMPT, max_tokens=48, ignore_eos=True, spec_method="none")
    assert again.token_ids == first.token_ids == dense.token_ids
    suffix = again.stats.drafters["suffix"]
    assert suffix["accepted"] >= 40 and suffix["passes"] <= 8  # whole chains of the earlier answer
    assert again.stats.target_passes < first.stats.target_passes


def test_a_request_with_nothing_in_common_drafts_nothing_from_it(engine):
    dense = engine.generate(PROMPT, max_tokens=48, ignore_eos=True, spec_method="none")
    engine.suffix_cache.clear()
    prompt_ids = engine.encode(PROMPT)
    unrelated = [t for t in range(engine.tokenizer.vocab_size) if t not in prompt_ids + dense.token_ids]
    engine.suffix_cache.add(unrelated * 3)  # held text made of tokens this request never sees
    result = engine.generate(PROMPT, max_tokens=48, ignore_eos=True)
    assert result.token_ids == dense.token_ids
    assert "suffix" not in result.stats.drafters
    assert engine.suffix_cache.stats.lookups > 0 and engine.suffix_cache.stats.hits == 0


def test_lossy_generations_are_not_remembered_and_seeded_samples_do_not_read_the_cache(engine):
    engine.generate(PROMPT, max_tokens=24, ignore_eos=True, strategy=Lossy())  # an early exit's kind
    assert engine.suffix_cache.stats.documents == 0
    engine.generate(PROMPT, max_tokens=24, ignore_eos=True)
    # A seeded sample's drafts decide its answer, so they must not depend on what the server saw.
    seeded = dict(max_tokens=24, ignore_eos=True, temperature=0.8, seed=3)
    with_history = engine.generate(PROMPT, **seeded)
    engine.suffix_cache.clear()
    assert engine.generate(PROMPT, **seeded).token_ids == with_history.token_ids
    assert "suffix" not in with_history.stats.drafters


def test_the_suffix_cache_size_is_a_load_option_and_zero_turns_it_off(engine):
    from specee.cli import build_parser
    from specee.engine import Engine

    args = build_parser().parse_args(["serve", "--suffix-cache-tokens", "0"])
    assert args.suffix_cache_tokens == 0
    off = Engine(engine.model, engine.tokenizer, suffix_cache_tokens=args.suffix_cache_tokens)
    dense = off.generate(PROMPT, max_tokens=48, ignore_eos=True, spec_method="none")
    for _ in range(2):
        again = off.generate(PROMPT, max_tokens=48, ignore_eos=True)
        assert again.token_ids == dense.token_ids and "suffix" not in again.stats.drafters
    assert off.suffix_cache.held == 0 and not off.suffix_cache.enabled
    assert Engine(engine.model, engine.tokenizer).suffix_cache.budget == 1 << 18  # None: the default
