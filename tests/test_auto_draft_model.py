"""`auto` with the user's draft model (`--draft-model`): consulted where the free drafters offer
nothing worth a row, its nodes paying for their rows and their draft passes, dropped by a guard of
its own while it does not pay (where it stands is shared by the engine's requests), and the answer
dense decoding's whatever it drafts."""
import statistics

import pytest
import torch

from helpers import tiny_model
from specee.drafters.dense_guard import FIRST_REST
from specee.drafters.draft_model import DraftModel
from specee.drafters.model_offer import ModelOffer
from specee.drafters.row_price import RowPrice
from specee.engine import Engine
from specee.strategies.config import SpecConfig

PROMPTS = ["Repeat exactly: the red fox, the red fox, the red fox.", "Count from one to ten in words.",
           "the cat sat on the mat and looked at the dog.", "Hello there, name three colours: red, green"]


@pytest.fixture
def engine(tiny_tokenizer):
    # Each test its own engine: the draft model's record is the engine's. No suffix cache: each
    # request drafts from its own text and its draft model only.
    return Engine(tiny_model(seed=5, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=2), tiny_tokenizer,
                  suffix_cache_tokens=0)


def priced(monkeypatch, share: float) -> list[int]:
    """Every draft pass costs `share` of a one-row pass and a row the model's price (not measured
    times, which vary from run to run); returns a list that counts consultations."""
    consulted = []
    chain = ModelOffer.chain

    def counted(self, *args):
        consulted.append(1)
        return chain(self, *args)

    monkeypatch.setattr(ModelOffer, "price", lambda self, one_row, measured: share)
    monkeypatch.setattr(RowPrice, "record", lambda self, rows, seconds: None)
    monkeypatch.setattr(ModelOffer, "chain", counted)
    return consulted


def test_a_cheap_draft_model_drafts_where_nothing_else_pays_and_the_answer_stays_dense(engine, monkeypatch):
    consulted = priced(monkeypatch, 0.02)
    drafted = accepted = 0
    for prompt in PROMPTS:
        dense = engine.generate(prompt, max_tokens=40, ignore_eos=True, spec_method="none")
        result = engine.generate(prompt, max_tokens=40, ignore_eos=True, draft_model="self:1")
        assert (result.text, result.token_ids, result.finish_reason) == (dense.text, dense.token_ids, dense.finish_reason)
        counts = result.stats.drafters.get("draft", {"drafted": 0, "accepted": 0})
        drafted, accepted = drafted + counts["drafted"], accepted + counts["accepted"]
        assert result.stats.method_passes.get("draft", 0) == result.stats.drafters.get("draft", {}).get("passes", 0)
    assert 0 < accepted < drafted  # its drafts were accepted and rejected: the identity is not trivial
    assert len(consulted) > 0
    # Without it, the same request never drafts from a model.
    assert "draft" not in engine.generate(PROMPTS[2], max_tokens=40, ignore_eos=True).stats.drafters


def test_a_draft_model_that_cannot_pay_is_dropped_within_a_few_passes(engine, monkeypatch):
    consulted = priced(monkeypatch, 0.4)  # no node can pay for its row and its draft pass
    dense = engine.generate(PROMPTS[1], max_tokens=64, ignore_eos=True, spec_method="none")
    result = engine.generate(PROMPTS[1], max_tokens=64, ignore_eos=True, draft_model="self:1")
    assert result.token_ids == dense.token_ids
    assert "draft" not in result.stats.drafters
    free_passes = result.stats.method_passes["none"]
    # Three fruitless consultations lose 1.2 dense steps and start a rest of 4 passes; each failed
    # probe doubles it (8, 16, 32).
    assert 3 <= len(consulted) <= 6 < free_passes
    # The engine remembers: the next request starts resting where this one stood.
    consulted.clear()
    engine.generate(PROMPTS[3], max_tokens=64, ignore_eos=True, draft_model="self:1")
    assert len(consulted) <= 2
    # ... but not a seeded sample, whose answer must not depend on earlier requests.
    consulted.clear()
    engine.generate(PROMPTS[3], max_tokens=64, ignore_eos=True, draft_model="self:1", temperature=0.8, seed=3)
    assert len(consulted) >= 3


def test_a_draft_model_that_pays_again_is_consulted_again_by_the_next_requests(engine, monkeypatch):
    priced(monkeypatch, 0.4)
    engine.generate(PROMPTS[0], max_tokens=64, ignore_eos=True, draft_model="self:1")
    record = engine.artifacts.load("draft-record", "self:1")
    assert record.rest_length > 2 * FIRST_REST  # it lost, and failed its probes
    consulted = priced(monkeypatch, 0.0)  # now free: its first probe pays and reopens it
    engine.generate(PROMPTS[2], max_tokens=200, ignore_eos=True, draft_model="self:1")
    assert record.rest_length == FIRST_REST
    consulted.clear()
    engine.generate(PROMPTS[1], max_tokens=16, ignore_eos=True, draft_model="self:1")
    assert len(consulted) >= 4  # the next request consults it from its first passes


def test_the_draft_models_price_is_its_measured_passes_over_a_one_row_pass(engine):
    offer = ModelOffer(DraftModel(engine.model, 1), bytes_share=0.6)
    context = engine.encode(PROMPTS[0])
    offer.reset(context)
    assert offer.price(0.01, measured=True) == 0.6  # nothing timed yet: the bytes' ratio
    with torch.inference_mode():
        tokens, reach, estimated, passes = offer.chain(context, 3, factor=1.0, floor=0.0)
    assert len(tokens) == passes == 3 and reach == estimated and sorted(reach, reverse=True) == reach
    assert offer.price(0.01, measured=True) == pytest.approx(statistics.median(offer.seconds) / 0.01)
    assert offer.price(0.01, measured=False) == 0.6  # a seeded sample never follows timing
    # A first node below the floor ends the chain at once, its pass spent.
    with torch.inference_mode():
        assert offer.chain(context + tokens, 3, factor=1.0, floor=1.01)[::3] == ([], 1)
        # A calibration below 1 lowers every reach, node by node.
        _, lowered, unlowered, _ = offer.chain(context, 3, factor=0.5, floor=0.0)
    assert all(low < high for low, high in zip(lowered, unlowered))


def test_only_methods_that_read_a_draft_model_take_one():
    assert SpecConfig.from_keywords({"draft_model": "self:2"}).method == "auto"
    for method in ("draft", "staged", "auto"):
        SpecConfig.from_keywords({"spec_method": method, "draft_model": "self:2"}).check()
    with pytest.raises(ValueError, match="draft_model applies to the draft, staged and auto methods, not prompt-lookup"):
        SpecConfig.from_keywords({"spec_method": "prompt-lookup", "draft_model": "self:2"})
