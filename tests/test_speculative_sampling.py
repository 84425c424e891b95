"""Speculative sampling end to end on a tiny model: the first two speculative tokens are
distributed exactly like plain sampling from the target, for chains and trees, with
temperature, top-k and top-p applied to target and draft alike.

Each case draws 2000 seeded samples and runs Pearson's chi-square test on the joint
distribution of the two tokens; a correct implementation fails a case with probability 1e-4
(seeds are fixed, so a run is repeatable), i.e. below 1e-3 for the whole file.
"""
import pytest
import torch

from helpers import chi_square_p_value, tiny_model
from specee.decoding.base import DecodeState
from specee.decoding.speculative import Speculative
from specee.drafters.draft_model import DraftModel
from specee.drafters.prompt_lookup import PromptLookup
from specee.sampling import Sampler, SamplingParams, processed_probs
from specee.stats import GenerationStats
from specee.tree import static_tree

VOCAB = 12
PROMPT = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7]
ROOT = 8  # forced first token, so both tested tokens come from speculative passes
SAMPLES = 2000
P_VALUE_THRESHOLD = 1e-4


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=7, vocab_size=VOCAB, num_hidden_layers=3)


def exact_joint(model, params) -> torch.Tensor:
    """P(t2, t3 | prompt, root) under plain sampling: [VOCAB * VOCAB]."""
    def next_probs(ids):
        logits = model(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(len(ids)))[-1:]
        return processed_probs(logits, params)[0].double()

    with torch.no_grad():
        first = next_probs(PROMPT + [ROOT])
        rows = torch.stack([next_probs(PROMPT + [ROOT, t]) for t in range(VOCAB)])
    return (first[:, None] * rows).flatten()


def sample_joint(model, make_strategy, params) -> torch.Tensor:
    counts = torch.zeros(VOCAB * VOCAB, dtype=torch.float64)
    forced = torch.full((1, VOCAB), -1e9)
    forced[0, ROOT] = 0.0
    strategy = make_strategy(model)
    with torch.no_grad():
        for seed in range(SAMPLES):
            cache = model.new_cache(64)
            model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), cache)
            sampler = Sampler(SamplingParams(params.temperature, params.top_k, params.top_p, seed=seed))
            state = DecodeState(model, cache, list(PROMPT), forced, sampler, GenerationStats())
            out = []
            for new in strategy.decode(state):
                out += new
                if len(out) >= 3:
                    break
            assert out[0] == ROOT
            counts[out[1] * VOCAB + out[2]] += 1
    return counts


def chain_from_shallow_layers(model):
    return Speculative(DraftModel(model, num_layers=1), num_draft_tokens=3, adaptive=False)


def dynamic_tree_from_draft(model):
    return Speculative(DraftModel(model, num_layers=2), num_draft_tokens=3, tree="auto", tree_budget=6,
                       tree_width=3)


def static_tree_from_draft(model):
    return Speculative(DraftModel(model, num_layers=1), num_draft_tokens=3,
                       tree=static_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]))


def prompt_lookup_chain(model):
    return Speculative(PromptLookup(max_ngram=3), num_draft_tokens=3, adaptive=False)


CASES = {
    "chain, temperature": (chain_from_shallow_layers, SamplingParams(temperature=0.9)),
    "chain, top-k": (chain_from_shallow_layers, SamplingParams(temperature=1.2, top_k=4)),
    "dynamic tree, top-p": (dynamic_tree_from_draft, SamplingParams(temperature=1.0, top_p=0.8)),
    "static tree, temperature": (static_tree_from_draft, SamplingParams(temperature=0.8)),
    "prompt lookup, top-k and top-p": (prompt_lookup_chain, SamplingParams(temperature=1.1, top_k=6, top_p=0.9)),
}


@pytest.mark.parametrize("case", CASES)
def test_speculative_sampling_matches_plain_sampling(model, case):
    make_strategy, params = CASES[case]
    expected = exact_joint(model, params)
    counts = sample_joint(model, make_strategy, params)
    assert chi_square_p_value(counts, expected) > P_VALUE_THRESHOLD


def test_the_test_can_fail(model):
    """Negative control: the draft's own samples (never verified) are caught by the same test."""
    params = SamplingParams(temperature=0.9)
    draft = DraftModel(model, num_layers=1)
    counts = torch.zeros(VOCAB * VOCAB, dtype=torch.float64)
    with torch.no_grad():
        for seed in range(SAMPLES):
            draft.reset(PROMPT, Sampler(SamplingParams(0.9, seed=seed)), 64)
            t2, t3 = draft.propose(PROMPT + [ROOT], 2).tokens
            counts[t2 * VOCAB + t3] += 1
    assert chi_square_p_value(counts, exact_joint(model, params)) < P_VALUE_THRESHOLD
