"""`auto` never speculates below dense decoding for long: when its latest drafted passes give fewer
tokens per unit of pass cost than dense steps, it rests drafting, for longer after each failed probe,
and the output is dense decoding's throughout."""
from helpers import tiny_model
from specee.drafters.auto import AutoDrafter
from specee.drafters.dense_guard import FIRST_REST, GUARD_PASSES, LONGEST_REST, MAX_CREDIT, BalanceGuard, DenseGuard
from specee.drafters.prompt_lookup import PromptLookup
from specee.engine import Engine
from specee.strategies.speculative import Speculative


class Table:
    """An n-gram table that always offers `token` with probability `prob`, whatever came before."""

    order = 3
    calibration = None  # unmeasured: auto takes it at half its word

    def __init__(self, token: int, prob: float) -> None:
        self.token, self.prob = token, prob

    def best_after(self, key: tuple[int, ...]) -> tuple[int, float]:
        return self.token, self.prob


class NoCopies(PromptLookup):
    """Prompt lookup that never finds a match, so the table's chains are all auto is offered."""

    def match(self, context: list[int]) -> tuple[int, list[int]]:
        return 0, []


def test_failing_passes_rest_drafting_for_longer_after_each_failed_probe():
    guard, cost = DenseGuard(), 1.8  # four drafted rows at 0.2 of a dense step each
    for _ in range(GUARD_PASSES - 1):
        guard.record(accepted=0, cost=cost)
    assert guard.open  # too few passes to judge
    guard.record(accepted=0, cost=cost)
    rests = []
    for _ in range(5):  # every probe fails: 4, 8, 16, ... dense passes between them
        assert not guard.open
        length = 0
        while not guard.open:
            guard.rest()
            length += 1
        rests.append(length)
        guard.record(accepted=0, cost=cost)  # the probe
    assert rests == [FIRST_REST * 2**i for i in range(5)]
    for _ in range(20):
        while not guard.open:
            guard.rest()
        guard.record(accepted=0, cost=cost)
    assert guard.resting <= LONGEST_REST
    while not guard.open:
        guard.rest()
    guard.record(accepted=3, cost=cost)  # a probe that pays: drafting resumes
    assert guard.open and guard.rest_length == FIRST_REST
    for _ in range(10):  # passes that pay keep it open
        guard.record(accepted=1, cost=cost)
    assert guard.open


def test_the_guard_stops_a_drafter_that_turned_bad_long_before_calibration_would():
    """After 20 passes whose chains were all accepted, the table's calibration trusts it 1.4x: it
    would keep drafting through 200 rejected passes and more (its trust falls to 0.34, and a 1-token
chain at 0.9 x 0.34 still pays on paper). The guard stops it within GUARD_PASSES."""
    auto = AutoDrafter(NoCopies(), Table(42, 0.9), row_cost=0.2)
    context = list(range(10, 30))
    auto.reset(context, None)
    for _ in range(20):
        draft = auto.propose(context, 8)
        assert draft.source == "ngram"
        context = context + draft.tokens + [42]
        auto.update(context, len(draft.tokens))
    assert auto.calibrations["ngram"].factor > 1.3
    def refused(passes: int) -> int:
        """`passes` passes whose drafts are all refused; returns how many drafted."""
        nonlocal context
        drafted = 0
        for _ in range(passes):
            drafted += bool(auto.propose(context, 8).tokens)
            context = context + [7]
            auto.update(context, 0)
        return drafted

    drafted = 0
    while auto.guard.open:  # every draft is refused now: the guard rests within GUARD_PASSES of them
        drafted += refused(1)
        assert drafted <= GUARD_PASSES
    assert auto.guard.resting == FIRST_REST
    # The rest, then a probe that is refused too: a rest twice as long.
    assert refused(FIRST_REST + 1) == 1 and auto.guard.resting == 2 * FIRST_REST
    assert auto.choose(context, 8).source == "ngram"  # calibration alone would still draft


def test_a_drafter_that_is_always_wrong_soon_drafts_nothing_and_the_answer_is_dense(tiny_tokenizer):
    engine = Engine(tiny_model(seed=5, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=2), tiny_tokenizer,
                    suffix_cache_tokens=0)
    prompt = "Write one line about the sea."
    dense = engine.generate(prompt, max_tokens=80, ignore_eos=True, spec_method="none")
    never = next(t for t in range(engine.tokenizer.vocab_size) if t not in dense.token_ids)
    wrong = Speculative(lambda: AutoDrafter(NoCopies(), Table(never, 1.0), row_cost=0.05), num_draft_tokens=8,
                        adaptive=False, name="auto")
    result = engine.generate(prompt, max_tokens=80, ignore_eos=True, strategy=wrong)
    assert result.token_ids == dense.token_ids
    drafters = result.stats.drafters
    assert drafters["ngram"]["accepted"] == 0
    # At most GUARD_PASSES passes, then one probe after each rest of 4, 8, 16, 32 dense passes
    # (calibration alone keeps drafting far longer: the test above).
    assert 1 <= drafters["ngram"]["passes"] <= GUARD_PASSES + 4
    assert drafters["none"]["passes"] >= 60


def test_a_drafter_that_costs_when_unused_rests_once_it_has_lost_a_dense_steps_worth():
    cheap = BalanceGuard()  # fruitless consultations at 0.02 of a dense step each
    for _ in range(49):
        cheap.record(accepted=0, cost=1.02)
    assert cheap.open  # 0.98 of a step lost so far
    cheap.record(accepted=2, cost=1.5)  # a draft that paid: +1.5, banked
    for _ in range(120):
        cheap.record(accepted=0, cost=1.02)
    assert not cheap.open  # 1.5 banked, then 2.4 lost
    dear = BalanceGuard()
    for _ in range(4):
        dear.record(accepted=3, cost=1.5)  # +2.5 each, but at most MAX_CREDIT banked
    assert dear.balance == MAX_CREDIT
    for _ in range(7):
        dear.record(accepted=0, cost=1.4)
    assert dear.open
    dear.record(accepted=0, cost=1.4)  # 8 x 0.4 = 3.2 lost against 2 banked
    assert not dear.open and dear.resting == FIRST_REST
    # Its probes are judged alone, as the dense guard's: a failed one doubles the rest.
    while not dear.open:
        dear.rest()
    dear.record(accepted=0, cost=1.4)
    assert dear.resting == 2 * FIRST_REST


def test_a_guard_resumes_where_an_earlier_one_of_the_same_drafter_stands():
    fresh = DenseGuard()
    fresh.resume(FIRST_REST)  # the earlier one never failed a probe: open
    assert fresh.open
    resumed = DenseGuard()
    resumed.resume(4 * FIRST_REST)  # its next rest would be 4 x the first: this one rests 2 x, then 4 x
    rested = 0
    while not resumed.open:
        resumed.rest()
        rested += 1
    assert rested == 2 * FIRST_REST and resumed.rest_length == 4 * FIRST_REST

