"""`auto`, the default method: it drafts the copy, the n-gram table's chain, the suffix cache's
continuation of earlier requests' text, or nothing, pass by pass, from this request's measured
acceptance and what a row costs now (alone, or in a batch), and its output is dense decoding's through
every switch. Its suffix cache and guard have their own files (test_suffix_cache.py,
test_dense_guard.py)."""
import json
import random

import numpy as np
import pytest
import torch

from helpers import tiny_model, tiny_model_directory
from specee.batch import Batch
from specee.cli import main
from specee.drafters.auto import (COSTLY_DRAFT_LIMIT, MARGIN, SUFFIX_DRAFT_LIMIT, SUFFIX_STREAK_LIMIT, AutoDrafter, Choice,
                                  RowPrice)
from specee.drafters.dense_guard import FIRST_REST
from specee.drafters.ngram import NgramModel
from specee.drafters.prompt_lookup import PromptLookup
from specee.drafters.suffix_cache import SuffixCache
from specee.engine import Engine
from specee.sampling import Sampler, SamplingParams
from specee.stats import GenerationStats
from specee.strategies.config import SpecConfig

PROMPTS = ["Repeat exactly: the red fox, the red fox, the red fox.", "Count from one to ten in words.",
           "the cat sat on the mat and looked at the dog.", "Hello there, name three colours: red, green"]
TABLE_TEXT = "the red fox ran. the cat sat on the mat. one two three four five six seven eight nine ten. " * 8


@pytest.fixture(scope="module")
def engine(tiny_tokenizer):
    # No suffix cache: these requests share prompts, and each must draft from its own text only.
    return Engine(tiny_model(seed=5, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=2), tiny_tokenizer,
                  suffix_cache_tokens=0)


@pytest.fixture(scope="module")
def table_path(tiny_tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("ngram") / "table.pt"
    NgramModel.train([tiny_tokenizer.encode(TABLE_TEXT)], tiny_tokenizer.vocab_size, progress=False).save(
        path, tiny_tokenizer.fingerprint)
    return str(path)


class Sharing:
    """What a batch member reports: other generations in the pass and their rows."""

    def __init__(self, others: int, rows: int) -> None:
        self.others, self.rows = others, rows

    def sharing(self) -> tuple[int, int]:
        return self.others, self.rows

    def sharing_next(self) -> tuple[int, int]:
        return self.others, self.rows


def drafter(row_cost: float = 0.2, table=None, passes=None, sampler=None) -> tuple[AutoDrafter, GenerationStats]:
    auto, stats = AutoDrafter(PromptLookup(), table, row_cost), GenerationStats()
    auto.reset(PATTERN, sampler)
    auto.watch(passes, stats)
    return auto, stats


PATTERN = [5, 6, 7, 8, 9, 10, 11, 12] * 3  # copies after it: 5, 6, 7, ...


def test_without_options_generations_run_auto_and_equal_dense_through_every_switch(engine, table_path):
    methods, switches, trees = {}, 0, 0
    for prompt in PROMPTS:
        dense = engine.generate(prompt, max_tokens=40, ignore_eos=True, spec_method="none")
        for options in ({}, {"spec_method": "auto", "ngram_model": table_path}):
            result = engine.generate(prompt, max_tokens=40, ignore_eos=True, **options)
            assert result.stats.method_passes.keys() <= {"prompt-lookup", "ngram", "none"}
            assert (result.text, result.token_ids, result.completion_tokens, result.finish_reason) == \
                (dense.text, dense.token_ids, dense.completion_tokens, dense.finish_reason), (prompt, options)
            assert sum(result.stats.method_passes.values()) == result.stats.target_passes
            # Each drafter's own counts add up to the request's.
            drafters = result.stats.drafters
            assert {m: c["passes"] for m, c in drafters.items() if c["passes"]} == result.stats.method_passes
            assert sum(c["drafted"] for c in drafters.values()) == result.stats.draft_nodes  # trees' branches too
            trees += sum(c["branches"] for c in drafters.values())
            # ... but the last pass's accepted drafts past max_tokens, which the answer cuts.
            assert 0 <= sum(c["accepted"] for c in drafters.values()) - result.stats.draft_tokens_accepted < 8
            assert drafters.get("none", {}).get("drafted", 0) == 0
            for method, count in result.stats.method_passes.items():
                methods[method] = methods.get(method, 0) + count
            switches += result.stats.switches
        assert dense.stats.method_passes == {"none": dense.stats.target_passes}
    # Every kind of pass was chosen somewhere, and the choice changed within requests.
    assert {"prompt-lookup", "ngram", "none"} <= methods.keys()
    assert switches > 4
    assert trees > 0  # rows are cheap here: the copy and the table's chain went out as one tree too
    assert engine.default_strategy.name == "auto"


def test_each_switch_is_explained_by_the_offer_and_acceptance_behind_it(engine, table_path):
    result = engine.generate(PROMPTS[0], max_tokens=40, ignore_eos=True, spec_method="auto", ngram_model=table_path)
    log = result.stats.switch_log
    assert 0 < len(log) == min(result.stats.switches, 32)
    for before, after in zip(log, log[1:]):
        assert after["from"] == before["to"] and after["at"] > before["at"]
    for switch in log:
        if switch["to"] == "none":  # nothing offered, or the best offer was not worth its rows
            assert switch["offer"] is None or switch["offer"]["gain"] <= 1 + MARGIN
        else:
            # (the log rounds gains to 3 places: one a hair above the margin reads as the margin)
            assert switch["offer"]["source"] == switch["to"] and switch["offer"]["gain"] >= 1 + MARGIN
        assert switch["row_cost"] > 0


def test_a_copy_is_drafted_alone_but_not_when_the_pass_is_full():
    context = PATTERN + [5, 6, 7]
    alone, _ = drafter()
    choice = alone.choose(context, 8)
    assert choice.source == "prompt-lookup" and choice.tokens == (PATTERN[3:] * 2)[:len(choice.tokens)]
    crowded, _ = drafter(passes=Sharing(7, 7))  # eight dense rows: a row must be surer than a copy here
    assert crowded.choose(context, 8).source == "none"
    # Three others' rows: still drafted, but shorter than alone.
    shared, _ = drafter(passes=Sharing(3, 3))
    assert 0 < len(shared.choose(context, 8).tokens) < len(choice.tokens)
    # A seeded sample prices rows as if alone, so its answer is the same in any batch.
    seeded, _ = drafter(passes=Sharing(7, 7), sampler=Sampler(SamplingParams(temperature=0.8, seed=1)))
    assert seeded.choose(context, 8).tokens == choice.tokens
    # Nor does it follow measured times, which differ from run to run: only the unseeded price moves.
    unseeded, unseeded_stats = drafter()
    seeded_stats = seeded.stats
    for auto, stats in ((seeded, seeded_stats), (unseeded, unseeded_stats)):
        for rows in (0, 2, 0, 3) * 5:
            auto.pending = Choice("prompt-lookup", context[:rows], 0.0, 0.0, 1.0)
            stats.verify_s += 0.010 + 0.006 * rows
            auto.update(context, 0)
    assert seeded.price.cost == 0.2 and unseeded.price.cost > 0.4
    # Where a row costs a whole pass (the portable tier), even a good copy does not pay.
    assert drafter(row_cost=1.0)[0].choose(context, 8).source == "none"


def test_a_drafter_whose_first_node_could_not_pay_for_its_row_is_not_asked(tiny_tokenizer, table_path):
    """The table's calibrated chance is at most its calibration factor: where that is below what
    a row costs in the pass, `auto` does not walk the table (its Python is a share of a crowded
    pass); alone, it does."""
    table = NgramModel.load(table_path, tiny_tokenizer.fingerprint)
    asked = []
    best_after = table.best_after
    table.best_after = lambda key: asked.append(key) or best_after(key)
    context = tiny_tokenizer.encode("the red fox ran. the cat sat on the")
    crowded, _ = drafter(table=table, passes=Sharing(7, 7))
    assert crowded.calibrations["ngram"].factor < crowded.price.cost * 8 / crowded.price.share(7)
    assert crowded.choose(context, 8).source == "none" and asked == []
    alone, _ = drafter(table=table)
    alone.choose(context, 8)
    assert asked and asked[0][-1] == context[-1]


class OneGuessTable:
    """An n-gram table that always guesses `token` with probability `prob`."""

    order = 3
    calibration = None  # unmeasured: auto takes it at half its word

    def __init__(self, token: int, prob: float) -> None:
        self.token, self.prob = token, prob

    def best_after(self, key) -> tuple[int, float]:
        return self.token, self.prob


def test_where_rows_are_cheap_a_second_drafters_guess_goes_beside_the_chain_as_a_tree():
    context = PATTERN + [5, 6, 7]  # the copy continues 8, 9, ...; the table guesses 99
    cheap, stats = drafter(row_cost=0.02, table=OneGuessTable(99, 0.9))
    choice = cheap.choose(context, 4)
    assert choice.source == "prompt-lookup" and choice.tokens == [8, 9, 10, 11]
    assert choice.branch is not None and choice.branch.source == "ngram" and choice.branch.tokens[0] == 99
    assert choice.gain > drafter(row_cost=0.02)[0].choose(context, 4).gain  # the copy alone
    branch = len(choice.branch.tokens)
    assert choice.draft.tokens == [8, 9, 10, 11] + choice.branch.tokens
    assert choice.draft.parents == [-1, 0, 1, 2, -1] + list(range(4, 4 + branch - 1))  # two chains from the root
    # The target took the branch's first token: the table is credited, the copy is not.
    cheap.propose(context, 4)
    cheap.update(context + [99, 3], 1)
    assert cheap.calibrations["ngram"].accepted == 1 and cheap.calibrations["prompt-lookup"].accepted == 0
    assert stats.drafters["ngram"]["branches"] == 1 and stats.drafters["prompt-lookup"]["passes"] == 1
    assert stats.drafters["ngram"]["drafted"] == branch
    # Where rows are dear, the same guess does not pay for its rows.
    dear, _ = drafter(row_cost=0.3, table=OneGuessTable(99, 0.9))
    assert dear.choose(context, 4).branch is None
    # Nor does a guess the copy already makes.
    agreeing, _ = drafter(row_cost=0.02, table=OneGuessTable(8, 0.9))
    assert agreeing.choose(context, 4).branch is None


def test_the_suffix_caches_chains_run_longer_than_the_others_where_rows_are_dear():
    """Where rows cost enough that copies are cut at COSTLY_DRAFT_LIMIT, an earlier answer held in
    the suffix cache is still drafted up to SUFFIX_DRAFT_LIMIT tokens: an agent's repeated call."""
    history = SuffixCache()
    answer = list(range(40, 60))
    history.add([3, 4] + PATTERN + answer)
    auto = AutoDrafter(PromptLookup(), None, 0.15, COSTLY_DRAFT_LIMIT, history, SUFFIX_DRAFT_LIMIT)
    auto.reset(PATTERN, None)
    auto.watch(None, GenerationStats())
    repeated = PATTERN + answer[:6]  # a long match: the cache trusts it
    choice = auto.choose(repeated, COSTLY_DRAFT_LIMIT, SUFFIX_DRAFT_LIMIT)
    assert choice.source == "suffix" and choice.tokens == answer[6:6 + len(choice.tokens)]
    assert COSTLY_DRAFT_LIMIT < len(choice.tokens) <= SUFFIX_DRAFT_LIMIT
    copy = auto.choose(PATTERN + [5, 6, 7], COSTLY_DRAFT_LIMIT, SUFFIX_DRAFT_LIMIT)  # no answer follows: a copy
    assert copy.source == "prompt-lookup" and 0 < len(copy.tokens) <= COSTLY_DRAFT_LIMIT
    assert auto.choose(repeated, COSTLY_DRAFT_LIMIT).tokens == choice.tokens[:COSTLY_DRAFT_LIMIT]  # one limit for all


def drafted_pass(auto: AutoDrafter, context: list[int], text: list[int], accepted: int | None = None,
                 source: str | None = None) -> int:
    """One pass over an answer that repeats `text` (its tokens distinct): the draft, which must
    follow the text (and come from `source`, where given), `accepted` of it kept (all when None)
    and the target's token after them (the text's next one, or 0 where it broke the draft).
    Returns the draft's length."""
    at = text.index(context[-1]) + 1  # where the answer is in the text
    draft = auto.propose(context, 64)
    assert draft.tokens == text[at:at + len(draft)] and source in (None, draft.source)
    kept = len(draft) if accepted is None else accepted
    context.extend(text[at:at + kept] + [text[at + kept] if accepted is None else 0])
    auto.update(context, kept)
    return len(draft)


def test_a_copy_accepted_whole_may_run_to_the_suffix_limit_until_one_breaks():
    """Where rows are dear, copies are cut at COSTLY_DRAFT_LIMIT; after one is accepted whole at that
    length the next may run to SUFFIX_DRAFT_LIMIT (a long verbatim repeat), and a copy that breaks
    brings the limit back."""
    text = list(range(100, 160))
    prompt = [3, 4] + text + [1, 2]
    auto = AutoDrafter(PromptLookup(num_draft_tokens=SUFFIX_DRAFT_LIMIT), None, 0.15, COSTLY_DRAFT_LIMIT, None,
                       SUFFIX_DRAFT_LIMIT)
    auto.reset(prompt, None)
    auto.watch(None, GenerationStats())
    context = prompt + text[:12]  # the answer repeats the text: a long match

    def copy(accepted: int | None = None) -> int:
        return drafted_pass(auto, context, text, accepted)

    assert copy() == COSTLY_DRAFT_LIMIT
    assert COSTLY_DRAFT_LIMIT < copy(accepted=3) <= SUFFIX_DRAFT_LIMIT  # the streak: past the usual limit
    context.extend(text[:14])  # the answer copies the text again, from its start
    auto.update(context, 0)
    assert copy() == COSTLY_DRAFT_LIMIT  # the broken copy ended the streak


def test_a_suffix_chain_accepted_whole_may_run_to_the_streak_limit_until_one_breaks():
    """An earlier answer in the suffix cache is drafted SUFFIX_DRAFT_LIMIT tokens at a time; after a
    chain is accepted whole at that length the next may run to SUFFIX_STREAK_LIMIT (an agent's call
    answered as before), and a chain that breaks brings the limit back."""
    history = SuffixCache()
    answer = list(range(100, 180))  # distinct tokens, none in the prompt: only the suffix cache offers them
    prompt = [3, 4, 5, 6, 7, 8, 9, 10]
    history.add(prompt + answer)
    auto = AutoDrafter(PromptLookup(), None, 0.05, COSTLY_DRAFT_LIMIT, history, SUFFIX_DRAFT_LIMIT,
                       suffix_streak_tokens=SUFFIX_STREAK_LIMIT)
    auto.reset(prompt, None)
    auto.watch(None, GenerationStats())
    context = prompt + answer[:6]

    def chain(accepted: int | None = None) -> int:
        return drafted_pass(auto, context, answer, accepted, source="suffix")

    assert chain() == SUFFIX_DRAFT_LIMIT
    assert SUFFIX_DRAFT_LIMIT < chain(accepted=5) <= SUFFIX_STREAK_LIMIT  # the streak: past the usual limit
    context.extend(answer[40:46])  # after the break, the answer picks up the earlier one further on
    auto.update(context, 0)
    assert chain() == SUFFIX_DRAFT_LIMIT  # the broken chain ended the streak


def test_failing_copies_turn_drafting_off_until_a_longer_match_appears():
    auto, stats = drafter()
    context = PATTERN + [5]
    for wrong in range(40, 52):  # each copy is refused: the text goes elsewhere
        draft = auto.propose(context, 8)
        if not draft.tokens:
            break
        context = context + [wrong]
        auto.update(context, 0)
    else:
        pytest.fail("the drafter kept copying after a dozen refusals")
    assert auto.calibrations["prompt-lookup"].factor < 1
    assert auto.propose(context + [5], 8).tokens == []  # a one-token match is no longer worth a row
    # The text starts repeating a long stretch: the copy is worth drafting again.
    stretch = [60, 61, 62, 63, 64, 65, 66, 67]
    repeated = context + stretch + [70] + stretch[:7]
    auto.lookup.update(repeated, 0)
    draft = auto.propose(repeated, 8)
    assert draft.source == "prompt-lookup" and draft.tokens[0] == 67
    assert [s["to"] for s in stats.switch_log][-2:] == ["none", "prompt-lookup"]


def test_the_row_price_follows_the_measured_passes():
    price = RowPrice(0.2)
    assert price.cost == 0.2
    for rows in [0, 2, 0, 1, 3, 0, 2] * 10:  # a pass costs 10 ms and 5 ms a row: a row is half a pass
        price.record(rows, 0.010 + 0.005 * rows)
    assert price.cost == pytest.approx(0.5, abs=0.02)
    for _ in range(40):  # only one shape of pass: nothing to fit a line to, the price stays
        price.record(2, 0.020)
    assert price.cost == pytest.approx(0.5, abs=0.05)
    cheap = RowPrice(0.2)
    for rows in [0, 4, 1, 0, 2] * 10:  # rows nearly free (fp32 weights)
        cheap.record(rows, 0.050 + 0.0005 * rows)
    assert cheap.cost == pytest.approx(0.01, abs=0.01)


def test_the_first_drafted_row_pays_a_step_the_price_follows():
    """Dense steps take 10 ms; a pass with k drafted rows 10 ms x (1 + 0.3 + 0.1 k): one line through
    every pass would price one drafted row at about half of what it costs."""
    price = RowPrice(0.2)
    for rows in [0, 1, 0, 4, 0, 2, 1, 0, 3] * 6:
        price.record(rows, 0.010 * (1 + (0.3 + 0.1 * rows if rows else 0)))
    assert price.step == pytest.approx(0.3, abs=0.02) and price.cost == pytest.approx(0.1, abs=0.01)
    assert price.share(1) == pytest.approx(1.4, rel=0.02) and price.share(0) == 1
    single = RowPrice(0.2)  # one drafted shape only: its whole cost, the model's price per row
    for rows in [0, 1, 0, 0, 1] * 6:
        single.record(rows, 0.010 * (1.5 if rows else 1))
    assert single.share(1) == pytest.approx(1.5, rel=0.02) and single.cost == pytest.approx(0.2)


def decayed_least_squares(rows: list[int], seconds: list[float]) -> float:
    """The row price as a least-squares line through the passes, each weighing 0.95 of the next:
    the estimator `auto` used before issue 50 (less its prior)."""
    x, y = np.array(rows, dtype=float), np.array(seconds)
    w = 0.95 ** np.arange(len(x) - 1, -1, -1)
    x_mean, y_mean = np.average(x, weights=w), np.average(y, weights=w)
    per_row = np.average((x - x_mean) * (y - y_mean), weights=w) / np.average((x - x_mean) ** 2, weights=w)
    return per_row / (y_mean - per_row * x_mean)


@pytest.mark.parametrize("seed", range(4))
def test_a_few_slow_passes_barely_move_the_row_price(seed):
    """Passes of 10 ms plus 3 ms a row (a row costs 0.3 of a pass), 5% noise; three of the latest
    sixteen run 10x slow (another process took the cores). The price stays within 10% of the clean
    run's, where a least-squares line through the same passes doubles: seeds 0-7 gave clean
    0.289-0.310, robust 0.277-0.307, the old estimator 0.624-0.699."""
    rng = random.Random(seed)
    rows = [0, 2, 0, 4, 1, 8] * 10
    clean = [0.010 * (1 + 0.3 * r) * (1 + rng.uniform(-0.05, 0.05)) for r in rows]
    slow = [t * 10 if i in (44, 53, 56) else t for i, t in enumerate(clean)]  # a dense pass, an 8-row, a dense
    prices = []
    for seconds in (clean, slow):
        price = RowPrice(0.1)  # the model's price is off: the passes must set it
        for r, t in zip(rows, seconds):
            price.record(r, t)
        prices.append(price.cost)
    assert prices[0] == pytest.approx(0.3, rel=0.1)
    assert prices[1] == pytest.approx(prices[0], rel=0.1)
    assert decayed_least_squares(rows, slow) > 1.5 * decayed_least_squares(rows, clean)  # the passes do mislead
    # A real change is followed: the context grew, a row now costs 0.6 of a pass.
    for r in rows:
        price.record(r, 0.010 * (1 + 0.6 * r))
    assert price.cost == pytest.approx(0.6, rel=0.05)


class Clock:
    """Stands in for the drafter's clock: each reading is `tick` seconds after the one before."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def decode_against(auto: AutoDrafter, stats: GenerationStats, text: list[int], start: int, steps: int) -> list[bool]:
    """Step `auto` through `text` from `start` as verification would (a draft is accepted as far as
    it agrees with the text), each pass 10 ms; returns whether each step consulted the drafters."""
    auto.reset(text[:start])
    auto.clock = Clock(0.0001)  # a consultation reads it twice choosing and twice scoring: 0.2 ms
    consulted, end = [], start
    for _ in range(steps):
        draft = auto.propose(text[:end], 8)
        accepted = 0
        while accepted < len(draft.tokens) and draft.tokens[accepted] == text[end + accepted]:
            accepted += 1
        consulted.append(not auto.last.resting)
        stats.verify_s += 0.010
        end += accepted + 1
        auto.update(text[:end], accepted)
    return consulted


def test_in_a_shared_pass_consultations_that_find_nothing_rest_once_their_time_cost_a_dense_step():
    """0.2 ms of each 10 ms pass, which 8 members share, is 16% of this member's token: after
    seven consultations that found nothing worth a row the balance is past a dense step lost, and
    the consultations (and the scoring of copies) rest for longer after each probe that finds nothing.
    Alone, the consultation is the pass's own business: it never rests for its time."""
    rng = random.Random(0)
    text = [rng.randrange(100, 110) for _ in range(200)]  # short matches everywhere, none worth a crowded row
    crowded, crowded_stats = drafter(passes=Sharing(7, 7))
    consulted = decode_against(crowded, crowded_stats, text, 40, 60)
    assert all(consulted[:7]) and not consulted[7]
    assert 8 <= sum(consulted) <= 12  # then probes after rests of 4, 8, 16, 32 passes
    # The next request of the same strategy starts resting (the others found consulting a loss here),
    # but probes its own text after the first rest; that probe found nothing either: a longer rest.
    assert crowded.consult_record.rest_length > 4 * FIRST_REST
    joining = AutoDrafter(PromptLookup(), None, 0.2, consult_record=crowded.consult_record)
    joining.watch(Sharing(7, 7), GenerationStats())
    later = decode_against(joining, joining.stats, text, 40, 20)
    assert later == [False] * FIRST_REST + [True] + [False] * 2 * FIRST_REST + [True] + [False] * 6
    alone, alone_stats = drafter()
    assert sum(decode_against(alone, alone_stats, text, 40, 60)) > 2 * sum(consulted)  # (its own guard rests failing copies)
    assert alone.consulting.balance == 0 and alone.consulting.rest_length == FIRST_REST  # never judged, never rested
    assert sum(crowded.lookup.reliability.trials) < sum(alone.lookup.reliability.trials) / 2


def test_in_a_shared_pass_consultations_whose_drafts_pay_go_on():
    text = PATTERN * 12
    auto, stats = drafter(passes=Sharing(1, 1))
    consulted = decode_against(auto, stats, text, len(PATTERN), 20)
    assert all(consulted) and auto.consulting.balance > 0
    assert stats.drafters["prompt-lookup"]["accepted"] > 20


def test_in_a_batch_auto_answers_as_alone_and_drafts_less(engine):
    prompt = PROMPTS[0]
    alone = engine.generate(prompt, max_tokens=40, ignore_eos=True)
    model = engine.model
    cost, model.extra_row_cost = model.extra_row_cost, 0.1  # a row dearer than this tiny model's
    try:
        priced = engine.strategy("auto")
        alone_priced = engine.generate(prompt, max_tokens=40, ignore_eos=True, strategy=priced)
        generations = [engine.stream(prompt, max_tokens=40, ignore_eos=True, strategy=priced)] + [
            engine.stream(p, max_tokens=50, ignore_eos=True, spec_method="none") for p in PROMPTS[1:] * 2]
        batch = Batch(model)
        for generation in generations:
            batch.add(generation)
        while batch.members:
            batch.advance()
            batch.run_pass()
    finally:
        model.extra_row_cost = cost
    crowded = generations[0].result
    assert crowded.token_ids == alone_priced.token_ids == alone.token_ids
    drafted = lambda r: sum(n for m, n in r.stats.method_passes.items() if m != "none")  # noqa: E731
    assert drafted(crowded) < drafted(alone_priced)


def test_where_rows_round_by_their_count_auto_drafts_nothing(tiny_tokenizer):
    """bf16 passes round by their row count, so a draft could change a greedy answer there."""
    model = tiny_model(seed=5, pack=False, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=2).to(torch.bfloat16)
    engine = Engine(model, tiny_tokenizer)
    assert not model.rows_exact
    result = engine.generate(PROMPTS[0], max_tokens=30, ignore_eos=True)
    assert result.stats.method_passes == {"none": result.stats.target_passes}
    assert result.token_ids == engine.generate(PROMPTS[0], max_tokens=30, ignore_eos=True,
                                               spec_method="none").token_ids


def test_the_default_depends_on_the_exit_and_merges_as_requests_expect():
    assert SpecConfig().method == SpecConfig.from_keywords({}).method == "auto"
    assert SpecConfig.from_keywords({"exit": "rule"}).method == "none"  # exits alone: plain decoding
    assert SpecConfig.from_keywords({"num_draft_tokens": 4}).num_draft_tokens == 4  # auto's longest draft
    server = SpecConfig.from_keywords({})
    assert server.keywords() == {}
    assert server.merged({"exit": "rule"}).method == "none"
    assert server.merged({"spec_method": "none"}).method == "none"
    dense_server = SpecConfig.from_keywords({"spec_method": "none"})
    assert dense_server.merged({"exit": "rule"}).method == "none"
    assert dense_server.keywords() == {"spec_method": "none"}


def test_the_command_line_runs_auto_unless_told_and_explains_it(tmp_path, capsys):
    directory = tiny_model_directory(tmp_path / "tiny", seed=5)
    common = ["generate", PROMPTS[0], "--model", str(directory), "--quantization", "none", "--no-compile",
              "--max-tokens", "30", "--ignore-eos", "--json"]
    answers = {}
    for name, flags in (("default", ["--verbose"]), ("dense", ["--spec-method", "none"])):
        assert main(common + flags) == 0
        out, err = capsys.readouterr()
        answers[name] = json.loads(out.strip().splitlines()[-1])
        answers[name]["err"] = err
    default, dense = answers["default"], answers["dense"]
    assert default["token_ids"] == dense["token_ids"] and default["text"] == dense["text"]
    assert dense["stats"]["method_passes"] == {"none": dense["stats"]["target_passes"]}
    assert sum(default["stats"]["method_passes"].values()) == default["stats"]["target_passes"]
    assert default["stats"]["method_passes"].get("prompt-lookup", 0) > 0
    assert f"{default['stats']['switches']} switches]" in default["err"]
    assert "passes by drafting method" not in dense["err"]
    assert "-> prompt-lookup (best offer prompt-lookup x" in default["err"]
    copies = default["stats"]["drafters"]["prompt-lookup"]
    assert (f"prompt-lookup: {copies['passes']} passes, {copies['drafted']} drafted, {copies['accepted']} accepted"
            in default["err"])
    assert "auto's drafters" not in dense["err"]
