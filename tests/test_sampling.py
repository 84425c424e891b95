"""Sampling: seeded determinism, and filters that never let a disallowed token through."""
import pytest
import torch

from helpers import tiny_model
from specee.sampling import Sampler, SamplingParams, argmax, processed_probs
from specee.stats import GenerationStats
from specee.strategies.base import DecodeState
from specee.strategies.dense import Autoregressive


def sample_tokens(model, params, n=20, prompt=(1, 2, 3)):
    cache = model.new_cache(64)
    with torch.no_grad():
        logits = model(torch.tensor(prompt), torch.arange(len(prompt)), cache)[-1:]
        state = DecodeState(model, cache, list(prompt), logits, Sampler(params), GenerationStats())
        steps = Autoregressive().decode(state)
        return [next(steps).tokens[0] for _ in range(n)]


def test_same_seed_gives_same_tokens_and_another_seed_differs():
    model = tiny_model(seed=5)
    a = sample_tokens(model, SamplingParams(temperature=1.0, seed=11))
    b = sample_tokens(model, SamplingParams(temperature=1.0, seed=11))
    c = sample_tokens(model, SamplingParams(temperature=1.0, seed=12))
    assert a == b
    assert a != c


def test_top_k_keeps_exactly_the_k_best():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    probs = processed_probs(logits, SamplingParams(temperature=0.8, top_k=5))
    for row_logits, row in zip(logits, probs):
        allowed = set(row_logits.topk(5).indices.tolist())
        assert set(row.nonzero().flatten().tolist()) == allowed
        assert row.sum().item() == pytest.approx(1.0, abs=1e-6)


def test_top_p_keeps_the_smallest_set_covering_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = processed_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert probs[0].nonzero().flatten().tolist() == [0, 1]
    torch.testing.assert_close(probs[0, :2], torch.tensor([0.625, 0.375]))
    probs = processed_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert probs[0].nonzero().flatten().tolist() == [0, 1]
    probs = processed_probs(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert probs[0].nonzero().flatten().tolist() == [0, 1, 2]


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.5), (4, 0.6)])
def test_sampled_tokens_stay_in_the_allowed_set(top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(1, 40) * 2
    params = SamplingParams(temperature=1.3, top_k=top_k, top_p=top_p, seed=3)
    allowed = set(processed_probs(logits, params)[0].nonzero().flatten().tolist())
    sampler = Sampler(params)
    drawn = {int(sampler.pick(logits)[0]) for _ in range(2000)}
    assert drawn <= allowed
    assert len(drawn) == len(allowed)  # and every allowed token shows up in 2000 draws


def test_greedy_picks_the_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 0.0, 4.9]])
    assert Sampler(SamplingParams()).pick(logits).tolist() == [1, 0]


def test_the_quick_argmax_is_torchs_with_ties_infinities_and_nan():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 3, (64, 1000), generator=generator).float()  # many tied maxima
    logits[5, 17] = logits[6, 900] = float("inf")
    logits[7, 3] = logits[7, 500] = float("nan")
    logits[8] = float("-inf")
    for rows in (logits, logits[:, ::3], logits[9:10]):  # strided and one-row views too
        assert torch.equal(argmax(rows), rows.argmax(-1))
        assert torch.equal(argmax(rows.double()), rows.double().argmax(-1))


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.01), dict(top_k=-1)])
def test_invalid_parameters_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
