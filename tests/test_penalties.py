"""Presence and frequency penalties and a logit bias: OpenAI's formula over the tokens generated so
far, and speculative decoding that applies it to every row of a pass with that row's own draft
path, so greedy output stays token-identical to dense decoding with the same penalties (sampling:
tests/test_speculative_sampling.py, "penalties and bias")."""
import pytest
import torch

from helpers import decode, tiny_model
from specee.drafters.draft_model import DraftModel
from specee.drafters.prompt_lookup import PromptLookup
from specee.engine import Engine
from specee.sampling import Sampler, SamplingParams
from specee.strategies.dense import Autoregressive
from specee.strategies.speculative import Speculative
from specee.verification.tree import static_tree


def test_penalties_count_the_output_and_each_rows_path_and_the_bias_adds():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((4, 2.0), (0, -1.0)))
    sampler = Sampler(params, prompt_length=2)
    tokens = [1, 0, 1, 1, 2]  # prompt [1, 0]; output [1, 1, 2]
    adjusted = sampler.adjusted(torch.zeros(2, 6), tokens, [[], [3, 1]])
    expected = torch.tensor([
        [-1.0, -(2 * 0.25 + 0.5), -(0.25 + 0.5), 0.0, 2.0, 0.0],  # the prompt's tokens are not counted
        [-1.0, -(3 * 0.25 + 0.5), -(0.25 + 0.5), -(0.25 + 0.5), 2.0, 0.0],  # its path adds 3 and one more 1
    ])
    torch.testing.assert_close(adjusted, expected, rtol=0, atol=0)
    plain = torch.randn(3, 6)
    assert Sampler(SamplingParams(), prompt_length=2).adjusted(plain, tokens) is plain


@pytest.mark.parametrize("kwargs", [dict(presence_penalty=2.5), dict(frequency_penalty=-2.01),
                                    dict(logit_bias=((1, 101.0),)), dict(logit_bias=((-1, 1.0),))])
def test_out_of_range_penalties_and_biases_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, vocab_size=64, num_hidden_layers=3)


PROMPT = [5, 9, 12, 5, 9, 12, 5, 9, 30, 31, 5, 9]
# Penalties that decide between drafts here: a row that ignored its own draft path would choose
# other tokens (test_the_test_catches_rows_that_ignore_their_path). Negative ones favour repeats.
FEWER_REPEATS = SamplingParams(presence_penalty=1.0, frequency_penalty=-2.0, logit_bias=((7, 1.5), (12, -3.0)))
MORE_REPEATS = SamplingParams(presence_penalty=-2.0, frequency_penalty=0.5, logit_bias=((7, 1.5),))
STRATEGIES = {
    "prompt-lookup chain": (lambda model: Speculative(lambda: PromptLookup(), num_draft_tokens=4), MORE_REPEATS),
    "draft chain": (lambda model: Speculative(lambda: DraftModel(model, num_layers=2), num_draft_tokens=3),
                    FEWER_REPEATS),
    "draft static tree": (lambda model: Speculative(lambda: DraftModel(model, num_layers=3), num_draft_tokens=3,
                                                    tree=static_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])),
                          MORE_REPEATS),
}


@pytest.mark.parametrize("name", STRATEGIES)
def test_greedy_speculative_with_penalties_equals_dense_with_them(model, name):
    make_strategy, params = STRATEGIES[name]
    dense, _, _ = decode(model, Autoregressive(), PROMPT, steps=40, params=params)
    plain, _, _ = decode(model, Autoregressive(), PROMPT, steps=40)
    assert dense != plain  # the penalties changed the answer
    speculative, stats, _ = decode(model, make_strategy(model), PROMPT, steps=40, params=params)
    assert speculative == dense
    assert stats.draft_tokens_accepted > 0  # drafts were kept, so rows past the first chose tokens


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_test_catches_rows_that_ignore_their_path(model, name, monkeypatch):
    make_strategy, params = STRATEGIES[name]
    dense, _, _ = decode(model, Autoregressive(), PROMPT, steps=40, params=params)
    adjusted = Sampler.adjusted
    monkeypatch.setattr(Sampler, "adjusted", lambda self, logits, tokens, paths=None: adjusted(self, logits, tokens))
    assert decode(model, make_strategy(model), PROMPT, steps=40, params=params)[0] != dense


def test_the_engine_takes_them_and_refuses_what_it_cannot_apply(tiny_tokenizer):
    model = tiny_model(seed=5, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=2)
    engine = Engine(model, tiny_tokenizer)
    plain = engine.generate("the cat sat", max_tokens=24, ignore_eos=True, spec_method="none")
    penalized = engine.generate("the cat sat", max_tokens=24, ignore_eos=True, presence_penalty=2.0,
                                frequency_penalty=2.0)
    assert len(set(penalized.token_ids)) > len(set(plain.token_ids))  # fewer repeats
    biased = engine.generate("the cat sat", max_tokens=6, ignore_eos=True, logit_bias={17: 100.0})
    assert biased.token_ids == [17] * 6
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate("the cat sat", max_tokens=2, logit_bias={tiny_tokenizer.vocab_size: 1.0})
