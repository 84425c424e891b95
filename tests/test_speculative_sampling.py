"""Speculative sampling end to end on a tiny model (int8 weights on the compiled kernels, as users
decode): the first two speculative tokens are distributed exactly like plain sampling from the
target, for chains and trees, with temperature, top-k and top-p applied to target and draft alike.

Each case draws 2000 seeded samples and runs Pearson's chi-square test on the joint
distribution of the two tokens; a correct implementation fails a case with probability 1e-4
(seeds are fixed, so a run is repeatable), i.e. below 1e-3 for the whole file. Power: over at most
143 degrees of freedom (12 x 12 cells), a sampler whose joint distribution q has a chi-square
divergence sum((q - p)^2 / p) >= 0.067 from the exact p fails its case with probability >= 0.99
(>= 0.039 over 30 degrees of freedom; scipy.stats.ncx2 with noncentrality 2000 x divergence); the
negative controls below are such samplers, caught.
"""
import dataclasses
import math

import pytest
import torch

from helpers import chi_square_p_value, first_tokens
from test_batch_invariance import kernel_model
from specee.drafters.auto import AutoDrafter
from specee.drafters.draft_model import DraftModel
from specee.drafters.eagle import EagleArtifact, EagleDrafter, EagleHead, EagleModel
from specee.drafters.kangaroo import Adapter, KangarooArtifact, KangarooDrafter, KangarooModel, KangarooSettings
from specee.drafters.model_offer import ModelOffer
from specee.drafters.ngram import NgramModel
from specee.drafters.prompt_lookup import PromptLookup
from specee.model.fingerprint import weights_fingerprint
from specee.sampling import Sampler, SamplingParams, processed_probs
from specee.stats import GenerationStats
from specee.strategies.base import DecodeState
from specee.strategies.speculative import Speculative
from specee.verification.draft import Draft
from specee.verification.tree import static_tree

VOCAB = 12
PROMPT = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7]
ROOT = 8  # forced first token, so both tested tokens come from speculative passes
SAMPLES = 2000
P_VALUE_THRESHOLD = 1e-4


@pytest.fixture(scope="module")
def model():
    # Int8 weights on the compiled kernels, as users decode: a pass is one kernel call, where
    # PyTorch's own kernels make dozens a layer (most of a sample's time at this size).
    return kernel_model("int8", seed=7, vocab_size=VOCAB, num_hidden_layers=3)


def exact_joint(model, params) -> torch.Tensor:
    """P(t2, t3 | prompt, root) under plain sampling: [VOCAB * VOCAB]."""
    def next_probs(ids):
        logits = model(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(len(ids)))[-1:]
        logits = Sampler(params, prompt_length=len(PROMPT)).adjusted(logits, ids)  # penalties on ids after PROMPT
        return processed_probs(logits, params)[0].double()

    with torch.inference_mode():  # as the engine decodes (and quicker per call than no_grad)
        first = next_probs(PROMPT + [ROOT])
        rows = torch.stack([next_probs(PROMPT + [ROOT, t]) for t in range(VOCAB)])
    return (first[:, None] * rows).flatten()


def sample_joint(model, make_strategy, params, samples: int = SAMPLES) -> torch.Tensor:
    counts = torch.zeros(VOCAB * VOCAB, dtype=torch.float64)
    forced = torch.full((1, VOCAB), -1e9)
    forced[0, ROOT] = 0.0
    strategy = make_strategy(model)
    split = getattr(strategy, "shallow_layers", None) or 0  # prefill as the engine does for Kangaroo
    with torch.inference_mode():  # as the engine decodes (and quicker per call than no_grad)
        prefilled = model.new_cache(64)  # the prompt once; every sample decodes from a copy
        positions = torch.arange(len(PROMPT))
        shallow = model.hidden(torch.tensor(PROMPT), positions, prefilled, layers=range(split))
        hidden = model.run_layers(shallow, positions, prefilled, layers=range(split, model.config.num_hidden_layers))
        for seed in range(samples):
            sampler = Sampler(dataclasses.replace(params, seed=seed), prompt_length=len(PROMPT))
            state = DecodeState(model, prefilled.copy(), list(PROMPT), forced, sampler, GenerationStats(), hidden,
                                shallow)
            out = first_tokens(strategy, state, 3)
            assert out[0] == ROOT
            counts[out[1] * VOCAB + out[2]] += 1
    return counts


def chain_from_shallow_layers(model):
    return Speculative(lambda: DraftModel(model, num_layers=1), num_draft_tokens=3, adaptive=False)


def confident_chain_from_shallow_layers(model):
    """Stops drafting where the draft's top probability is below 0.5 (decided before drawing)."""
    return Speculative(lambda: DraftModel(model, num_layers=1, confidence_threshold=0.5), num_draft_tokens=3,
                       adaptive=False)


def dynamic_tree_from_draft(model):
    return Speculative(lambda: DraftModel(model, num_layers=2), num_draft_tokens=3, tree="auto", tree_budget=6,
                       tree_width=3)


def static_tree_from_draft(model):
    return Speculative(lambda: DraftModel(model, num_layers=1), num_draft_tokens=3,
                       tree=static_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]))


def static_tree_from_the_whole_target(model):
    """Candidates from every layer (without the request's penalties): t2 is mostly accepted, so
    t3 mostly comes from t2's own row of the same pass."""
    return Speculative(lambda: DraftModel(model, num_layers=model.config.num_hidden_layers), num_draft_tokens=3,
                       tree=static_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]))


def prompt_lookup_chain(model):
    return Speculative(lambda: PromptLookup(max_ngram=3), num_draft_tokens=3, adaptive=False)


def auto_copy_table_and_draft_model(model):
    """`auto` choosing between the copy, a table trained on the prompt's own pattern and a draft
    model (the first layer), with rows and draft passes priced so that all three drafters' chains
    occur (the draft model's in about a third of the passes, where the free drafters offer nothing)."""
    table = NgramModel.train([PROMPT * 4], VOCAB, progress=False)
    return Speculative(lambda: AutoDrafter(PromptLookup(), table, row_cost=0.1, max_tokens=3,
                                           model=ModelOffer(DraftModel(model, num_layers=1), bytes_share=0.02)),
                       3, adaptive=False)


def auto_copy_and_table_as_trees(model):
    """`auto` where rows cost almost nothing: where the copy and the table guess different tokens,
    both go out as one tree of two chains (every sample's first pass here): the table learnt
    another text, so it guesses 9 where the prompt's copy guesses 5."""
    table = NgramModel.train([[7, 8, 9, 10, 11] * 8], VOCAB, progress=False)
    return Speculative(lambda: AutoDrafter(PromptLookup(), table, row_cost=0.01, max_tokens=3), 3, adaptive=False)


def eagle_tree(model):
    """An untrained feature head over a reduced vocabulary (tokens 0-7 of 12): deterministic top-k
    tree drafts that are often wrong, and never tokens 8-11."""
    torch.manual_seed(0)
    artifact = EagleArtifact(EagleHead(model.config).state_dict(), torch.arange(8), weights_fingerprint(model))
    eagle = EagleModel(model, artifact)
    return Speculative(lambda: EagleDrafter(eagle, 3, 3, 6, 0.0), 3, tree_budget=6, tree_width=3, adaptive=False)


def eagle_copy(copy_alone: float):
    """The same head with prompt lookup's copy (the prompt repeats itself): mixed into the tree
    (copy_alone 1), or drafted alone wherever there is one (copy_alone 0)."""
    def make(model):
        torch.manual_seed(0)
        artifact = EagleArtifact(EagleHead(model.config).state_dict(), torch.arange(8), weights_fingerprint(model))
        eagle = EagleModel(model, artifact)
        return Speculative(lambda: EagleDrafter(eagle, 3, 3, 6, 0.0, PromptLookup(num_draft_tokens=4), copy_alone),
                           4, tree_budget=6, tree_width=3, adaptive=False)

    return make


def kangaroo_chain(model):
    """An untrained Kangaroo adapter on the first layer, over a reduced vocabulary (tokens 0-7 of
    12), stopping after a token whose top-1 probability is below 0.3: chains drawn from the
    adapter's processed distribution, of varying length, verified from layer 1 up."""
    torch.manual_seed(0)
    artifact = KangarooArtifact(Adapter(model.config).state_dict(), torch.arange(8), weights_fingerprint(model),
                                KangarooSettings(1, 0.3, 3))
    kangaroo = KangarooModel(model, artifact)
    return Speculative(lambda: KangarooDrafter(kangaroo, 0.3, 3), 3, adaptive=False, shallow_layers=1)


# Negative penalties encourage repeats, so each row's own draft path matters: with it counted,
# P(t3 = t2) is 16% here; without, 2%.
PENALIZED = SamplingParams(temperature=1.0, presence_penalty=-1.5, frequency_penalty=-1.0, logit_bias=((3, 1.0),))

CASES = {
    "chain, temperature": (chain_from_shallow_layers, SamplingParams(temperature=0.9)),
    "chain, top-k": (chain_from_shallow_layers, SamplingParams(temperature=1.2, top_k=4)),
    "chain, draft confidence": (confident_chain_from_shallow_layers, SamplingParams(temperature=1.0)),
    "dynamic tree, top-p": (dynamic_tree_from_draft, SamplingParams(temperature=1.0, top_p=0.8)),
    "static tree, temperature": (static_tree_from_draft, SamplingParams(temperature=0.8)),
    # Penalties count each row's own path: t3's row in a tree counts the t2 above it.
    "static tree, penalties and bias": (static_tree_from_the_whole_target, PENALIZED),
    "prompt lookup, top-k and top-p": (prompt_lookup_chain, SamplingParams(temperature=1.1, top_k=6, top_p=0.9)),
    "auto, temperature": (auto_copy_table_and_draft_model, SamplingParams(temperature=0.9)),
    "auto with trees, top-p": (auto_copy_and_table_as_trees, SamplingParams(temperature=1.0, top_p=0.9)),
    "eagle tree, reduced vocabulary, temperature": (eagle_tree, SamplingParams(temperature=0.9)),
    "eagle tree mixed with the copy, temperature": (eagle_copy(1.0), SamplingParams(temperature=0.9)),
    "copy alone in eagle-copy, top-p": (eagle_copy(0.0), SamplingParams(temperature=1.0, top_p=0.9)),
    "kangaroo chain, reduced vocabulary, temperature": (kangaroo_chain, SamplingParams(temperature=0.9)),
    "kangaroo chain, top-k": (kangaroo_chain, SamplingParams(temperature=1.1, top_k=5)),
}


# Each case samples for seconds: all run in the full run. The fast tier keeps the acceptance rule's
# own distribution tests (tests/test_acceptance.py).
@pytest.mark.slow
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
    with torch.inference_mode():  # as the engine decodes (and quicker per call than no_grad)
        for seed in range(SAMPLES):
            draft.reset(PROMPT, Sampler(SamplingParams(0.9, seed=seed)))
            t2, t3 = draft.propose(PROMPT + [ROOT], 2).tokens
            counts[t2 * VOCAB + t3] += 1
    assert chi_square_p_value(counts, exact_joint(model, params)) < P_VALUE_THRESHOLD


@pytest.mark.slow
def test_the_test_catches_penalties_that_ignore_the_draft_path(model, monkeypatch):
    """Negative control for the penalized case: rows penalized for the output before the pass
    only (not for their own draft path) are caught."""
    adjusted = Sampler.adjusted
    monkeypatch.setattr(Sampler, "adjusted", lambda self, logits, tokens, paths=None: adjusted(self, logits, tokens))
    # A quarter of the case's samples: caught with fewer, it is caught with all of them.
    counts = sample_joint(model, static_tree_from_the_whole_target, PENALIZED, SAMPLES // 4)
    monkeypatch.undo()
    assert chi_square_p_value(counts, exact_joint(model, PENALIZED)) < P_VALUE_THRESHOLD


# --- Draft confidence: a bias of 0.05 must be caught --------------------------------------------
# With target p = (.5, .5) everywhere, draft q = (.9, .1) everywhere and threshold .5, a rule that
# stops after seeing the probability of the token it just drew (and drops that token) emits the
# second speculative token as (.55, .45); deciding before drawing keeps (.5, .5). With 4000 samples
# the standard error of a share is 0.0079, so a 0.05 bias is 6.3 standard errors: the chi-square
# test below (false-failure chance 1e-4, i.e. |z| > 3.89) catches it with probability 0.99.
CONFIDENCE_SAMPLES = 4000


def constant_model(log_odds: float):
    """A two-token model whose next-token distribution is softmax((log_odds, 0)) after any input:
    the layers add nothing (zero output projections) and every embedding row is the same. fp32
    weights on the compiled kernels, as the engine decodes."""
    def constant(state: dict) -> None:
        for name, weight in state.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weight.zero_()
            elif name.endswith(("norm.weight", "embed_tokens.weight")):
                weight.fill_(1.0)
        head = state["lm_head.weight"]
        head.zero_()
        head[0].fill_(log_odds / head.shape[1])  # the normed state is all ones

    return kernel_model("none", seed=1, vocab_size=2, num_hidden_layers=1, edit=constant)


class ConfidenceAfterDrawing(DraftModel):
    """The biased rule this project once had: draw, then drop the token and stop if its own
    probability is below the threshold."""

    def propose(self, context, max_tokens):
        tokens, dists = [], []
        for _ in range(max_tokens):
            probs = self.sampler.probs(self.logits_after(context + tokens))[0]
            token = int(torch.multinomial(probs, 1, generator=self.sampler.generator))
            if tokens and probs[token] < self.confidence_threshold:
                break
            tokens.append(token)
            dists.append(probs)
        return Draft.chain(tokens, q=torch.stack(dists), sampled=True)


def second_token_counts(draft_class) -> torch.Tensor:
    target, draft = constant_model(0.0), constant_model(math.log(9.0))
    counts = torch.zeros(2, dtype=torch.float64)
    forced = torch.tensor([[0.0, -1e9]])
    strategy = Speculative(lambda: draft_class(draft, confidence_threshold=0.5), num_draft_tokens=2, adaptive=False)
    prompt = [0, 1, 0, 1]
    with torch.inference_mode():  # as the engine decodes (and quicker per call than no_grad)
        prefilled = target.new_cache(32)
        target(torch.tensor(prompt), torch.arange(len(prompt)), prefilled)
        for seed in range(CONFIDENCE_SAMPLES):
            state = DecodeState(target, prefilled.copy(), list(prompt), forced, Sampler(SamplingParams(1.0, seed=seed)),
                                GenerationStats())
            out = []
            for step in strategy.decode(state):
                out += step.tokens
                if len(out) >= 3:
                    break
            counts[out[2]] += 1
    return counts


@pytest.mark.slow
def test_draft_confidence_keeps_the_target_distribution():
    counts = second_token_counts(DraftModel)
    assert chi_square_p_value(counts, torch.tensor([0.5, 0.5])) > P_VALUE_THRESHOLD


@pytest.mark.slow
def test_the_confidence_test_catches_a_bias_of_five_points():
    counts = second_token_counts(ConfidenceAfterDrawing)
    assert chi_square_p_value(counts, torch.tensor([0.5, 0.5])) < P_VALUE_THRESHOLD
    assert counts[0] / counts.sum() > 0.53  # the bias has the predicted direction and size
