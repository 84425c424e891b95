"""`auto`: speculation that pays for itself, request by request and pass by pass.

Each pass it weighs what the cheap drafters offer (prompt lookup's copy, the n-gram table's chain,
the engine's suffix cache of earlier requests' text) against what rows cost now, and drafts the
offer and length that give the most tokens per unit of pass cost, or nothing (a dense step) when
no draft beats one token for one row. Where rows are cheap enough, another drafter's chain whose
first token differs goes beside it as a second branch from the root (a tree of two chains, one
pass verifying both), if its nodes add more tokens than their rows cost. A node's chance of
acceptance is the drafter's own estimate (the copy's measured reliability for its match length,
the table's probability, the suffix cache's rate for its match length) times this request's
calibration: accepted over expected draft tokens of that drafter so far. So a request whose
copies keep failing stops drafting, and one whose text becomes copyable (a match appears) starts
again; a guard (dense_guard.py) rests drafting when the latest drafted passes gave fewer tokens per
unit of cost than dense steps. In a pass shared with other generations, consulting the drafters is
itself a cost: every member waits for each one's Python between passes, and a full batch finds
little worth a row. A second guard there keeps a balance of what the drafts gained against that
time and their rows, and rests the consultations (and prompt lookup's scoring of its copies) once
they have lost a dense step's worth; where it stands is shared by the strategy's requests, so a
short request joining a full batch starts where the others left off. Given a draft model
(`--draft-model`), it consults that model where the free drafters offer nothing worth a row, each
node paying for its row and its draft pass (model_offer.py). Every draft is verified by the target, so the output is dense decoding's,
whatever it chooses.

A row's price, as a share of a one-row pass, starts at the model's `extra_row_cost` and follows
this request's own passes (row_price.py: a median line through their verification times against
their rows, which a few slow passes barely move, above a step that any drafted row pays): a row
attends to the whole context, so at a few thousand tokens it costs several times what it does at a
hundred. In a server batch the pass also carries the other generations' rows and tokens, and the
draft maximises the whole pass's tokens per cost: the more rows already share a pass, the surer a
draft token must be.

Where a multi-row pass rounds differently from one-row passes (bf16), greedy speculation could
change the answer, so `auto` drafts nothing there: it always gives dense decoding's output.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..verification.draft import Draft
from .base import Proposer
from .copy_reliability import MAX_MATCH
from .dense_guard import FIRST_REST, BalanceGuard, DenseGuard, GuardRecord
from .draft_model import DraftModel, draft_weights
from .model_offer import ModelOffer
from .ngram import NgramModel
from .prompt_lookup import PromptLookup
from .registry import Drafting, SpecMethod, register
from .row_price import RowPrice
from .suffix_cache import SuffixCache, hit_rate

# A draft must promise this much more than a dense step's tokens per cost: the model of a pass's
# cost leaves out verification's own overhead (tuning slice, BENCHMARKS.md "Speculation on by default").
MARGIN = 0.05
# A drafter's calibration starts at its prior and weighs as much as this many expected draft tokens.
# The priors are accepted over expected draft tokens on the tuning slice (BENCHMARKS.md): the copy's
# rates are measured ones; a table's probabilities are its corpus's, so its prior is the calibration
# `specee train ngram` measured on held-out text, or (a table without one) half its word; the suffix
# cache's rates are a prior still to be measured (suffix_cache.py).
CALIBRATION_WEIGHT = 8.0
PRIORS = {"prompt-lookup": 1.0, "ngram": 0.5, "suffix": 1.0}
# A draft model's top probabilities, taken at their word until the request measures them.
DRAFT_MODEL_PRIOR = 1.0
# The longest chain, unless the user sets num_draft_tokens; where a row costs at least COSTLY_ROW
# of a pass (the quantized formats), chains of 4 matched or beat 8 on the tuning slice: a long copy
# rejected at its first token wastes several passes' work.
DRAFT_LIMIT = 8
COSTLY_ROW = 0.1
COSTLY_DRAFT_LIMIT = 4
# The suffix cache's chains run to DRAFT_LIMIT whatever rows cost: they copy what earlier requests
# produced, which an agent's repeated calls bring back nearly whole (BENCHMARKS.md, "Attention
# that shares its loads"); each node still pays for its row or is cut.
SUFFIX_DRAFT_LIMIT = DRAFT_LIMIT
# After a suffix-cache chain is accepted whole at its limit, the next may run this far (an agent's
# call sent again answers as before, token for token); a chain that breaks ends the streak.
SUFFIX_STREAK_LIMIT = 2 * SUFFIX_DRAFT_LIMIT


@dataclass
class Offer:
    """A chain one drafter offers, with the chance that its first i + 1 nodes are all accepted:
    calibrated (`reach`) and as the drafter estimates it (`estimated`)."""

    source: str
    tokens: list[int]
    reach: list[float]
    estimated: list[float]
    node_cost: float = 0.0  # drafting one node, as a share of a one-row pass (a draft model's pass)


class Calibration:
    """How a drafter's estimates fare in this request: accepted draft tokens over the drafter's own
    expectation of them, starting from `prior`."""

    def __init__(self, prior: float) -> None:
        self.prior = prior
        self.expected = 0.0
        self.accepted = 0
        self.drafted = 0

    @property
    def factor(self) -> float:
        return (CALIBRATION_WEIGHT * self.prior + self.accepted) / (CALIBRATION_WEIGHT + self.expected)

    def record(self, expected: float, drafted: int, accepted: int) -> None:
        self.expected += expected
        self.drafted += drafted
        self.accepted += accepted

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


@dataclass
class Branch:
    """A second chain from the root beside the chosen one: another drafter's, whose first token differs."""

    source: str
    tokens: list[int]
    estimated: float  # draft tokens the drafter expects to be accepted


@dataclass
class Choice:
    source: str  # the drafter whose chain is drafted, or "none"
    tokens: list[int]
    expected: float  # draft tokens expected to be accepted
    estimated: float  # ... as the drafter estimates it (before this request's calibration)
    gain: float  # tokens per unit of pass cost it promises, over a dense step's
    # The best offer, taken or not: (source, nodes, expected, gain).
    best: tuple[str, int, float, float] | None = None
    resting: bool = False  # nothing drafted because the guard rests drafting
    branch: Branch | None = None  # drafted beside the chain, the two verified as one tree

    @property
    def draft(self) -> Draft:
        if self.branch is None:
            return Draft.chain(self.tokens, source=self.source)
        k, j = len(self.tokens), len(self.branch.tokens)
        parents = list(range(-1, k - 1)) + [-1] + list(range(k, k + j - 1))
        return Draft(self.tokens + self.branch.tokens, parents, source=self.source)


class AutoDrafter(Proposer):
    margin = MARGIN
    clock = staticmethod(time.perf_counter)  # times the consultations (a test's clock may stand in)

    def __init__(self, lookup: PromptLookup, table: NgramModel | None, row_cost: float,
                 max_tokens: int = DRAFT_LIMIT, history: SuffixCache | None = None,
                 suffix_max_tokens: int | None = None, model: ModelOffer | None = None,
                 suffix_streak_tokens: int | None = None, consult_record: GuardRecord | None = None) -> None:
        self.lookup = lookup
        self.table = table
        self.model = model  # the user's draft model, consulted where the free drafters offer nothing
        self.consulted: tuple[int, float] | None = None  # this pass's draft-model passes and their price
        self.history = history  # the engine's suffix cache, shared by its generations (read only here)
        self.row_cost = row_cost
        self.max_tokens = max_tokens
        self.suffix_max_tokens = max_tokens if suffix_max_tokens is None else suffix_max_tokens
        self.suffix_streak_tokens = self.suffix_max_tokens if suffix_streak_tokens is None else suffix_streak_tokens
        self.suffix_streak = False  # the latest suffix chain was accepted whole at its limit
        # The latest copy was accepted whole at full length: the next may run to the suffix cache's
        # limit, so a long verbatim copy (an agent repeating an earlier answer) takes half the
        # passes; a copy that breaks ends the streak (BENCHMARKS.md, "A copy accepted whole").
        self.copy_streak = False
        self.passes = None
        self.stats = None
        self.reproducible = False
        self.prompt_tokens = 0
        self.calibrations: dict[str, Calibration] = {}
        self.last: Choice | None = None  # the latest choice (a switch is a change of source)
        self.pending: Choice | None = None  # the choice verification has not yet answered
        self.price = RowPrice(row_cost)
        self.guard = DenseGuard()
        self.consulting = BalanceGuard()  # in shared passes: consulting must pay for its own time
        self.consult_record = consult_record or GuardRecord()  # ... as the strategy's requests found it
        self.consult_s = 0.0  # this step's seconds of choosing and of scoring copies
        self.timed = 0.0  # the stats' verification seconds already read

    def reset(self, prompt: list[int], sampler=None) -> None:
        # A seeded sample depends on the drafts it was verified against, so a seeded request
        # prices rows at the model's price, as if alone: its answer is the same in any batch and
        # on any run (measured times vary). Greedy answers are dense decoding's whatever is drafted.
        self.reproducible = sampler is not None and not sampler.greedy and sampler.params.seed is not None
        self.lookup.reset(prompt)
        self.prompt_tokens = len(prompt)
        priors = PRIORS | ({"draft": DRAFT_MODEL_PRIOR} if self.model is not None else {})
        if self.table is not None and self.table.calibration is not None:
            priors["ngram"] = self.table.calibration  # measured where the table was trained
        self.calibrations = {source: Calibration(prior) for source, prior in priors.items()}
        if self.model is not None:
            self.model.reset(prompt, shared=not self.reproducible)
        self.consulted = None
        self.last = self.pending = None
        self.copy_streak = self.suffix_streak = False
        self.price = RowPrice(self.row_cost)
        self.guard = DenseGuard()
        self.consulting = BalanceGuard()
        # Where the strategy's requests found consulting in shared passes a loss, this one starts
        # resting too, but only for the first rest: its own text may copy, and its probe finds out.
        # (A seeded request never shares a pass: it is never judged.)
        if not self.reproducible:
            self.consulting.resume(min(self.consult_record.rest_length, 2 * FIRST_REST))
        self.consult_s = 0.0
        self.timed = 0.0

    def watch(self, passes, stats) -> None:
        self.passes, self.stats = passes, stats

    def sharing(self, coming: bool = False) -> tuple[int, int]:
        """(other generations in the pass, their rows): in the pass just run (what a draft's cost is
        judged by), or `coming` (what the next draft's rows are priced against)."""
        if self.passes is None or self.reproducible:
            return 0, 0
        return self.passes.sharing_next() if coming else self.passes.sharing()

    def offers(self, context: list[int], limit: int, floor: float, suffix_limit: int | None = None) -> list[Offer]:
        """What each drafter offers (chains of up to `limit` tokens, the suffix cache's up to
        `suffix_limit`), each cut where a node's reach falls below `floor` (reaches only fall, so no
        later node could pay for its row)."""
        offers = []
        suffix_limit = limit if suffix_limit is None else suffix_limit
        n, follows = self.lookup.match(context)
        if n:
            length = self.lookup.match_length(context, follows, n)
            rate = self.lookup.reliability.rate
            # Reaches only fall: a first node below the floor leaves nothing worth copying.
            if min(1.0, rate(length) * self.calibrations["prompt-lookup"].factor) >= floor:
                copy_limit = max(limit, self.suffix_max_tokens) if self.copy_streak else limit
                copied = self.lookup.chain(context, follows, copy_limit).tokens
                rates = [rate(min(length + i, MAX_MATCH)) for i in range(len(copied))]
                offers.append(self.chain_offer("prompt-lookup", copied, rates, floor))
        # A seeded sample's answer depends on its drafts, so it must not depend on other requests.
        match = None if self.history is None or self.reproducible else self.history.lookup(context, suffix_limit)
        if match is not None:
            rates = [hit_rate(match.length + i) for i in range(len(match.continuation))]
            offers.append(self.chain_offer("suffix", match.continuation, rates, floor))
        if self.table is not None and (offer := self.table_offer(context, limit, floor)) is not None:
            offers.append(offer)
        return offers

    def table_offer(self, context: list[int], limit: int, floor: float) -> Offer | None:
        """The n-gram table's chain, cut where its calibrated reach falls below `floor`; None where
        nothing is left, and without asking the table where even a certain first node could not
        pay (a node's calibrated chance never exceeds the table's factor)."""
        factor = self.calibrations["ngram"].factor
        if min(1.0, factor) < floor:
            return None
        keep = self.table.order - 1  # the tokens a node's prediction depends on
        key = tuple(context[max(0, len(context) - keep):])
        tokens, probs, reach = [], [], [1.0]
        while len(tokens) < limit:
            token, prob = self.table.best_after(key)
            if reach[-1] * min(1.0, prob * factor) < floor:
                break
            tokens.append(token)
            probs.append(prob)
            reach.append(reach[-1] * min(1.0, prob * factor))
            key = (*key, token)[-keep:] if keep else ()
        return Offer("ngram", tokens, reach[1:], reaching(probs, 1.0)) if tokens else None

    def chain_offer(self, source: str, tokens: list[int], rates: list[float], floor: float) -> Offer:
        """A chain whose node i is right with chance rates[i] as its drafter estimates it, cut where
        its calibrated reach falls below `floor`."""
        reach = reaching(rates, self.calibrations[source].factor, floor)
        return Offer(source, tokens[:len(reach)], reach, reaching(rates[:len(reach)], 1.0))

    def choose(self, context: list[int], limit: int, suffix_limit: int | None = None) -> Choice:
        """The offer and length with the most tokens per unit of pass cost, or none."""
        others, other_rows = self.sharing(coming=True)
        price = self.price

        def value(drafted: int, expected: float, drafting: float = 0.0) -> float:  # the pass's tokens over its cost
            return (others + 1 + expected) / (price.share(other_rows + drafted) + drafting)

        dense = value(0, 0.0)
        best = None

        def weigh(offer: Offer) -> None:
            nonlocal best
            expected = 0.0
            for k, reach in enumerate(offer.reach, start=1):
                expected += reach
                gain = value(k, expected, offer.node_cost * k) / dense
                if best is None or gain > best[3]:
                    best = (offer, k, expected, gain)

        # A node adds to the tokens per cost only if its reach is above a row's price times the
        # value so far, which a draft worth taking has above the dense step's.
        offers = self.offers(context, limit, price.cost * dense, suffix_limit)
        for offer in offers:
            weigh(offer)
        self.consulted = None
        if self.model is not None and limit and (best is None or best[3] <= 1 + self.margin):
            offer = self.model_offer(context, limit, dense)
            if offer is not None:
                weigh(offer)
        if best is None:
            return Choice("none", [], 0.0, 0.0, 1.0)
        offer, k, expected, gain = best
        summary = (offer.source, k, expected, gain)
        if gain <= 1 + self.margin:
            return Choice("none", [], 0.0, 0.0, 1.0, summary)
        branch = None
        if not offer.node_cost:
            branch, gain = second_branch(offers, offer, k, expected, gain,
                                         lambda rows, tokens: value(rows, tokens) / dense)
        return Choice(offer.source, offer.tokens[:k], expected, sum(offer.estimated[:k]), gain, summary, branch=branch)

    def model_offer(self, context: list[int], limit: int, dense: float) -> Offer | None:
        """The draft model's chain, each node paying for its row and its draft pass; None while
        its guard rests it."""
        if not self.model.open:
            return None
        node_cost = self.model.price(self.price.one_row, measured=not self.reproducible)
        factor = self.calibrations["draft"].factor
        tokens, reach, estimated, passes = self.model.chain(context, limit, factor, (self.price.cost + node_cost) * dense)
        self.consulted = (passes, node_cost)
        return Offer("draft", tokens, reach, estimated, node_cost)

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        if not self.guard.open:
            self.guard.rest()
            choice = Choice("none", [], 0.0, 0.0, 1.0, resting=True)
        elif not self.consulting.open and self.sharing()[0]:
            self.consulting.rest()
            choice = Choice("none", [], 0.0, 0.0, 1.0, resting=True)
        else:
            began = self.clock()
            suffix_limit = self.suffix_streak_tokens if self.suffix_streak else self.suffix_max_tokens
            choice = self.choose(context, min(max_tokens, self.max_tokens), min(max_tokens, suffix_limit))
            self.consult_s = self.clock() - began
        if self.last is not None and choice.source != self.last.source and self.stats is not None:
            self.stats.record_switch(lambda: self.explain(context, choice))
        self.last = self.pending = choice
        return choice.draft

    def explain(self, context: list[int], choice: Choice) -> dict:
        """A switch, with what this request measured that made it: the best offer (taken, or not
        worth its rows) and each drafter's acceptance so far."""
        acceptance = {source: round(c.acceptance, 3) for source, c in self.calibrations.items()
                      if c.acceptance is not None}
        offer = None if choice.best is None else dict(zip(("source", "draft", "expected", "gain"), choice.best))
        if offer is not None:
            offer["expected"], offer["gain"] = round(offer["expected"], 2), round(offer["gain"], 3)
        return {"at": len(context) - self.prompt_tokens, "from": self.last.source, "to": choice.source,
                "offer": offer, "acceptance": acceptance, "row_cost": round(self.price.cost, 3),
                "row_step": round(self.price.step, 3),
                "sharing": list(self.sharing(coming=True)), "resting": choice.resting}

    def update(self, context: list[int], num_accepted: int) -> None:
        choice, self.pending = self.pending, None  # None: a pass auto did not draft (a grammar's)
        consulted = choice is not None and not choice.resting
        began = self.clock()
        # A resting consultation in a shared pass leaves the copies unscored; one alone always scores.
        self.lookup.update(context, num_accepted, score=consulted or self.consulting.open)
        if consulted:
            self.consult_s += self.clock() - began
        drafted = 0 if choice is None else len(choice.tokens)
        branch = None if choice is None else choice.branch
        rows = drafted + (len(branch.tokens) if branch is not None else 0)
        # The accepted path went down the branch if it starts with the branch's first token.
        on_branch = branch is not None and num_accepted > 0 and context[-num_accepted - 1] == branch.tokens[0]
        chain_accepted = 0 if on_branch else num_accepted
        sharing = self.sharing()
        if drafted and choice.source == "prompt-lookup":
            self.copy_streak = chain_accepted == drafted and drafted >= self.max_tokens
        if drafted and choice.source == "suffix":
            self.suffix_streak = chain_accepted == drafted and drafted >= self.suffix_max_tokens
        drafting = 0.0  # what consulting the draft model cost, in one-row passes
        if self.consulted is not None:
            passes, node_cost = self.consulted
            drafting, self.consulted = passes * node_cost, None
            if not (drafted and choice.source == "draft"):  # consulted for nothing: a dense step's token, dearer
                self.model.judge(0, 1 + drafting)
        if drafted:
            self.calibrations[choice.source].record(choice.estimated, drafted, chain_accepted)
            if branch is not None:
                self.calibrations[branch.source].record(branch.estimated, len(branch.tokens),
                                                        num_accepted - chain_accepted)
            other_rows = sharing[1]  # the pass against the dense step it replaced
            cost = (self.price.share(other_rows + rows) + drafting) / self.price.share(other_rows)
            # The draft model answers to its own guard: its losses must not rest the free drafters.
            if choice.source == "draft":
                self.model.judge(num_accepted, cost)
            else:
                self.guard.record(num_accepted, cost, shared=sharing != (0, 0))
        if self.stats is not None:
            if choice is not None:
                self.stats.record_drafter(choice.source, drafted, chain_accepted)
            if branch is not None:
                self.stats.record_drafter(branch.source, len(branch.tokens), num_accepted - chain_accepted,
                                          branch=True)
            seconds, self.timed = self.stats.verify_s - self.timed, self.stats.verify_s
            alone = sharing == (0, 0)  # a pass of its own: its time is its rows'
            if choice is not None and alone and not self.reproducible:
                self.price.record(rows, seconds)
            if consulted and not alone and seconds > 0:
                self.judge_consulting(num_accepted, cost if drafted else 1.0, sharing[0], seconds)
        self.consult_s = 0.0

    def judge_consulting(self, accepted: int, cost: float, others: int, seconds: float) -> None:
        """A consultation in a shared pass: the pass gave this member accepted + 1 tokens and cost
        `cost` dense steps; the consultation's time delayed the pass (`seconds`, as this member
        waited for it) for every member. Both are charged at the whole batch's rate of tokens, a
        dense step bringing each of the others + 1 members one."""
        delay = self.consult_s / seconds
        rest_length = self.consulting.rest_length
        self.consulting.record(accepted, 1 + (others + 1) * (cost - 1 + delay), shared=True)
        if self.consulting.rest_length != rest_length:  # a rest began, or a probe paid: news for the others
            self.consult_record.rest_length = self.consulting.rest_length

    def take_bytes_read(self) -> int:
        return super().take_bytes_read() + (self.model.take_bytes_read() if self.model is not None else 0)


def second_branch(offers: list[Offer], chosen: Offer, k: int, expected: float, gain: float,
                  gain_of) -> tuple[Branch | None, float]:
    """The other free drafter's chain worth drafting beside the first k nodes of `chosen`, as a
    second branch from the root, and the gain of the two; (None, gain) where none adds to it.
    `gain_of(rows, tokens)`: a pass's gain over a dense step. The branches' first tokens differ, so
    at most one is accepted and their expected tokens add; the branch's first node is taken to be
    right at most as often as the chain's is wrong (drafters' guesses may together claim more)."""
    best = None
    for offer in offers:
        if offer is chosen or offer.node_cost or not offer.tokens or offer.tokens[0] == chosen.tokens[0]:
            continue
        scale = min(1.0, (1.0 - chosen.reach[0]) / offer.reach[0]) if offer.reach[0] > 0 else 0.0
        added = 0.0
        for j, reach in enumerate(offer.reach, start=1):
            added += reach * scale
            option = gain_of(k + j, expected + added)
            if option > gain:
                gain, best = option, Branch(offer.source, offer.tokens[:j], sum(offer.estimated[:j]))
    return best, gain


def reaching(rates: list[float], factor: float, floor: float = 0.0) -> list[float]:
    """The chance that every node up to each one is accepted, node by node, while it is at least
    `floor`."""
    reach, out = 1.0, []
    for rate in rates:
        reach *= min(1.0, rate * factor)
        if reach < floor:
            break
        out.append(reach)
    return out


def _auto_method(config, artifacts) -> Drafting:
    table = None
    try:  # the table is used where one exists for this model's tokenizer
        table = artifacts.load("ngram", config.ngram_model)
    except ValueError:
        if config.ngram_model is not None:
            raise
    row_cost = artifacts.model.extra_row_cost
    limit = config.num_draft_tokens or (DRAFT_LIMIT if row_cost < COSTLY_ROW else COSTLY_DRAFT_LIMIT)
    suffix_limit = config.num_draft_tokens or SUFFIX_DRAFT_LIMIT
    streak_limit = config.num_draft_tokens or SUFFIX_STREAK_LIMIT
    if not artifacts.model.rows_exact:
        limit = suffix_limit = streak_limit = 0  # drafts would not be lossless here: every pass is a dense step
    history = artifacts.suffix_cache  # the engine's, shared by all its generations
    make_model = draft_model_offer(config, artifacts)
    consult_record = GuardRecord()  # shared by the requests of this strategy (the server builds one per configuration)
    return Drafting(lambda: AutoDrafter(PromptLookup(num_draft_tokens=max(limit, suffix_limit, 1)), table, row_cost, limit, history,
                                        suffix_limit, make_model(), streak_limit, consult_record),
                    num_draft_tokens=max(limit, streak_limit, 1), adaptive=False)


def draft_model_offer(config, artifacts):
    """A maker of the user's draft model for one generation (None without --draft-model)."""
    if config.draft_model is None:
        return lambda: None
    weights, layers = draft_weights(artifacts, config.draft_model)
    vocab_size = artifacts.model.config.vocab_size
    share = DraftModel(weights, layers, vocab_size=vocab_size).pass_bytes / artifacts.model.weight_bytes
    record = artifacts.load("draft-record", config.draft_model)  # the engine's, shared by its requests
    return lambda: ModelOffer(DraftModel(weights, layers, vocab_size=vocab_size), share, record)


register(SpecMethod("auto", _auto_method, sizes_itself=True, options=("draft_model",), bench={"auto": {}}))
