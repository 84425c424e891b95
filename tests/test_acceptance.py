"""Acceptance rules: hand-computed greedy cases and distribution tests for sampling.

The distribution tests decode two tokens over a 6-token vocabulary with context-dependent target
and draft tables, drafting chains or trees, and compare the counts of the first token and of the
first two tokens with the exact target probabilities by Pearson's chi-square test. A test fails
when the p-value is below 1e-4: for a correct rule that happens for about 1 in 10,000 seeds, and
the fixed seeds make each run repeat exactly.
"""
import random
from collections import Counter

import pytest
import torch

from specee.verification.acceptance import accept_greedy, accept_sampling
from specee.verification.draft import Draft
from specee.verification.tree import TreeLayout

VOCAB = 6
TRIALS = 20_000
P_VALUE_THRESHOLD = 1e-4


# --- greedy -----------------------------------------------------------------------------------


def test_greedy_rejects_first_token():
    assert accept_greedy(Draft.chain([5, 6, 7]), torch.tensor([9, 6, 7, 8])) == ([], 9)


def test_greedy_accepts_prefix_then_corrects():
    assert accept_greedy(Draft.chain([5, 6, 7]), torch.tensor([5, 6, 1, 2])) == ([0, 1], 1)


def test_greedy_accepts_whole_chain_and_adds_bonus():
    assert accept_greedy(Draft.chain([5, 6, 7]), torch.tensor([5, 6, 7, 8])) == ([0, 1, 2], 8)


def test_greedy_follows_the_second_branch_of_a_tree():
    # root -> 0 (5) -> 2 (7);  root -> 1 (6) -> 3 (8)
    draft = Draft([5, 6, 7, 8], [-1, -1, 0, 1])
    target_argmax = torch.tensor([6, 7, 8, 0, 3])  # rows: root, node 0, node 1, node 2, node 3
    assert accept_greedy(draft, target_argmax) == ([1, 3], 3)


def test_greedy_on_empty_draft_returns_target_argmax():
    assert accept_greedy(Draft.empty(), torch.tensor([4])) == ([], 4)


# --- sampling: tables -------------------------------------------------------------------------


class BigramTable:
    """Next-token distributions that depend on the last token only: row 0 for the empty context.

    Half softmax(1.5 * normal), half uniform, so every kept token has probability >= 1/(2 VOCAB)
    before truncation and every chi-square cell expects hundreds of counts. `keep` < VOCAB
    truncates each row to its `keep` most probable tokens (like top-k): exact zeros.
    """

    def __init__(self, seed: int, keep: int = VOCAB):
        g = torch.Generator().manual_seed(seed)
        logits = 1.5 * torch.randn(1 + VOCAB, VOCAB, generator=g, dtype=torch.float64)
        rows = 0.5 * logits.softmax(dim=1) + 0.5 / VOCAB  # [1 + VOCAB, VOCAB]
        if keep < VOCAB:
            rows = rows.scatter(1, rows.argsort(dim=1)[:, : VOCAB - keep], 0.0)
        self.rows = rows / rows.sum(dim=1, keepdim=True)
        # Plain lists so the per-trial drafting stays cheap.
        self.weights = self.rows.tolist()
        self.ranked = self.rows.argsort(dim=1, descending=True, stable=True).tolist()

    @staticmethod
    def index(context: list[int]) -> int:
        return 0 if not context else 1 + context[-1]

    def row(self, context: list[int]) -> torch.Tensor:
        return self.rows[self.index(context)]

    def first_two_probs(self) -> torch.Tensor:
        return (self.rows[0][:, None] * self.rows[1:]).flatten()  # [VOCAB * VOCAB], a * VOCAB + b


# --- sampling: drafting and decoding ----------------------------------------------------------


def draft_tree(drafter: BigramTable, context, widths, rng, sampled) -> Draft:
    """Children per depth from `widths`: i.i.d. draws from q when `sampled`, else q's top-k."""
    tokens, parents, q_rows = [], [], []
    frontier = [(-1, context)]  # (node, context up to and including the node)
    for width in widths:
        next_frontier = []
        for parent, path in frontier:
            at = drafter.index(path)
            if sampled:
                picks = rng.choices(range(VOCAB), weights=drafter.weights[at], k=width)
            else:
                picks = drafter.ranked[at][:width]
            for token in picks:
                next_frontier.append((len(tokens), path + [token]))
                tokens.append(token)
                parents.append(parent)
                q_rows.append(at)
        frontier = next_frontier
    return Draft(tokens, parents, drafter.rows[q_rows], sampled)


def target_rows(target: BigramTable, context, draft) -> torch.Tensor:
    # A bigram table only needs each node's own token as its context.
    return target.rows[[target.index(context)] + [1 + token for token in draft.tokens]]


def decode_two_tokens(target, drafter, widths, sampled, seed, rule=accept_sampling, flag=None):
    """Counts of the first two decoded tokens over TRIALS runs of draft -> verify -> extend.

    `flag` overrides the draft's `sampled` flag seen by the rule (for deliberately wrong setups).
    """
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    counts = Counter()
    for _ in range(TRIALS):
        output: list[int] = []
        while len(output) < 2:
            draft = draft_tree(drafter, output, widths, rng, sampled)
            if flag is not None:
                draft.sampled = flag
            accepted, next_token = rule(draft, target_rows(target, output, draft), generator)
            output += [draft.tokens[i] for i in accepted] + [next_token]
        counts[output[0] * VOCAB + output[1]] += 1
    return torch.tensor([counts[i] for i in range(VOCAB * VOCAB)], dtype=torch.float64)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test over the cells with non-zero probability; cells with zero must be empty."""
    support = probs > 0
    assert counts[~support].sum() == 0, "a token with target probability 0 was emitted"
    expected = probs[support] * counts.sum()
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    degrees = torch.tensor((int(support.sum()) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(degrees, statistic / 2).item()  # chi-square survival function


def first_token_counts(counts_two: torch.Tensor) -> torch.Tensor:
    return counts_two.view(VOCAB, VOCAB).sum(dim=1)


def assert_matches_target(counts_two: torch.Tensor, target: BigramTable):
    assert chi_square_p_value(first_token_counts(counts_two), target.rows[0]) > P_VALUE_THRESHOLD
    assert chi_square_p_value(counts_two, target.first_two_probs()) > P_VALUE_THRESHOLD


# --- sampling: distribution tests -------------------------------------------------------------


def test_chain_drafted_from_q_keeps_target_distribution():
    target, drafter = BigramTable(1), BigramTable(2)
    assert_matches_target(decode_two_tokens(target, drafter, (1, 1, 1), True, seed=11), target)


def test_tree_with_iid_sampled_siblings_keeps_target_distribution():
    target, drafter = BigramTable(3), BigramTable(4)
    assert_matches_target(decode_two_tokens(target, drafter, (3, 2), True, seed=12), target)


def test_tree_with_top_k_siblings_keeps_target_distribution():
    """q is given but sampled=False: the rule must treat each child as a one-hot draft."""
    target, drafter = BigramTable(5), BigramTable(6)
    assert_matches_target(decode_two_tokens(target, drafter, (3, 2), False, seed=13), target)


def without_q(draft, target_probs, generator):
    return accept_sampling(Draft(draft.tokens, draft.parents), target_probs, generator)


@pytest.mark.parametrize(
    "widths, sampled, rule",
    [((1, 1), True, accept_sampling), ((3, 1), True, accept_sampling), ((2, 2), False, without_q)],
)
def test_truncated_target_and_draft_keep_target_distribution(widths, sampled, rule):
    """Zeros in p (top-3 target) and in q (top-4 drafter): no zero-probability token, no NaN."""
    target, drafter = BigramTable(7, keep=3), BigramTable(8, keep=4)
    assert_matches_target(decode_two_tokens(target, drafter, widths, sampled, 14, rule), target)


# --- negative controls: the same test catches wrong rules -------------------------------------


def accept_everything(draft, target_probs, generator):
    """Wrong on purpose: follows the first child at every depth, so the output follows q."""
    layout, path, node = TreeLayout.of(draft), [], -1
    while layout.children(node):
        node = layout.children(node)[0]
        path.append(node)
    return path, torch.multinomial(target_probs[node + 1], 1, generator=generator).item()


def test_distribution_test_detects_accepting_everything():
    target, drafter = BigramTable(1), BigramTable(2)
    counts = decode_two_tokens(target, drafter, (1, 1), True, 15, accept_everything)
    assert chi_square_p_value(first_token_counts(counts), target.rows[0]) < P_VALUE_THRESHOLD


def test_distribution_test_detects_q_rule_on_top_k_siblings():
    """Wrong on purpose: top-k picks verified as if drawn from q; min(1, p/q) is biased there."""
    target, drafter = BigramTable(5), BigramTable(6)
    counts = decode_two_tokens(target, drafter, (2, 1), False, 16, flag=True)
    assert chi_square_p_value(first_token_counts(counts), target.rows[0]) < P_VALUE_THRESHOLD


# --- sampling: exact edge cases ---------------------------------------------------------------


def test_sampling_is_repeatable_with_the_same_seed():
    target, drafter = BigramTable(1), BigramTable(2)
    draft = draft_tree(drafter, [], (2, 2), random.Random(0), True)
    probs = target_rows(target, [], draft)
    runs = [
        [accept_sampling(draft, probs, generator) for _ in range(50)]
        for generator in (torch.Generator().manual_seed(3), torch.Generator().manual_seed(3))
    ]
    assert runs[0] == runs[1]


def test_draft_equal_to_target_is_always_accepted_and_residual_stays_finite():
    """q == p gives acceptance probability 1; a one-hot target accepts its token, never NaN."""
    p = torch.tensor([0.0, 1.0, 0.0, 0.0])
    draft = Draft.chain([1, 1], q=p.repeat(2, 1), sampled=True)
    probs = p.repeat(3, 1)
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert accept_sampling(draft, probs, generator) == ([0, 1], 1)
    # Rejecting the only non-zero token empties the residual: the fallback must keep sampling valid.
    rejected = Draft([2, 1], [-1, -1])
    for _ in range(20):
        assert accept_sampling(rejected, probs, generator) == ([1], 1)
