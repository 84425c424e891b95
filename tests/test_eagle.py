"""The EAGLE-style feature head on tiny random models: exact greedy output, the reduced
vocabulary, artifacts (reload, refusal for another model) and training."""
import pytest
import torch

from helpers import tiny_model
from specee.decoding.autoregressive import Autoregressive
from specee.decoding.base import DecodeState
from specee.decoding.speculative import Speculative
from specee.drafters.eagle import EagleArtifact, EagleDrafter, EagleHead, EagleModel
from specee.model.fingerprint import weights_fingerprint
from specee.sampling import Sampler, SamplingParams
from specee.stats import GenerationStats
from specee.train.eagle import EagleTrainConfig, choose_vocabulary, collect, fit_head

VOCAB = 97
PROMPTS = [[3, 14, 15, 92, 65, 35], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [50, 60, 70], [7] * 12]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


def random_artifact(model, vocab=None, seed=0) -> EagleArtifact:
    torch.manual_seed(seed)
    head = EagleHead(model.config)
    vocab = torch.arange(model.config.vocab_size) if vocab is None else vocab
    return EagleArtifact(head.state_dict(), vocab, weights_fingerprint(model))


def eagle_strategy(model, artifact, depth=4, width=3, budget=6):
    eagle = EagleModel(model, artifact)
    return Speculative(lambda: EagleDrafter(eagle, depth, width, budget, 0.0), depth, tree_budget=budget,
                       tree_width=width, adaptive=False, name="eagle")


def decode(model, strategy, prompt, steps=30, params=SamplingParams()):
    """The first `steps` tokens the strategy commits after `prompt`, and the run's stats."""
    with torch.inference_mode():
        cache = model.new_cache(len(prompt) + steps + 80)
        hidden = model.hidden(torch.tensor(prompt), torch.arange(len(prompt)), cache)
        logits = model.logits(model.norm(hidden[-1:]))
        state = DecodeState(model, cache, list(prompt), logits, Sampler(params), GenerationStats(), hidden)
        out = []
        for new in strategy.decode(state):
            out += new
            if len(out) >= steps:
                break
    return out[:steps], state.stats


def own_continuations(model, count=24, length=60) -> list[list[int]]:
    """The tiny model's own greedy continuations of random starts: what a head learns from."""
    chunks = []
    for seed in range(count):
        start = torch.randint(0, VOCAB, (4,), generator=torch.Generator().manual_seed(seed)).tolist()
        chunks.append(start + decode(model, Autoregressive(), start, steps=length)[0])
    return chunks


@pytest.fixture(scope="module")
def trained(model):
    """(artifact, training figures) of a head trained for ~340 steps on the model's own text."""
    data = collect(model, own_continuations(model))
    vocab, _ = choose_vocabulary(data.top_counts, 1.0)
    head, figures = fit_head(model, data, vocab, EagleTrainConfig(epochs=15, lr=3e-3, warmup_steps=10))
    return EagleArtifact(head.state_dict(), vocab, weights_fingerprint(model)), figures


def test_training_lowers_the_loss(trained):
    _, figures = trained
    assert figures["steps"] > 100
    assert figures["final_loss"] < 0.85 * figures["first_loss"]


def test_greedy_eagle_equals_dense(model, trained):
    artifact, _ = trained
    proposed = accepted = 0
    for artifact_under_test in (artifact, random_artifact(model)):  # a trained and an untrained head
        for prompt in PROMPTS:
            dense, _ = decode(model, Autoregressive(), prompt)
            drafted, stats = decode(model, eagle_strategy(model, artifact_under_test), prompt)
            assert drafted == dense
            proposed += stats.draft_tokens_proposed
            accepted += stats.draft_tokens_accepted
    assert 0 < accepted < proposed


def test_reduced_vocabulary_never_drafts_outside_it(model, monkeypatch):
    vocab = torch.arange(0, VOCAB, 3)  # a third of the tokens
    artifact = random_artifact(model, vocab)
    eagle = EagleModel(model, artifact)
    allowed = set(vocab.tolist())
    seen = set()
    original = EagleDrafter.propose

    def checked(self, context, max_tokens):
        draft = original(self, context, max_tokens)
        seen.update(draft.tokens)
        return draft

    monkeypatch.setattr(EagleDrafter, "propose", checked)
    for prompt in PROMPTS:
        dense, _ = decode(model, Autoregressive(), prompt)
        strategy = Speculative(lambda: EagleDrafter(eagle, 4, 4, 8, 0.0), 4, tree_budget=8, adaptive=False)
        assert decode(model, strategy, prompt)[0] == dense
    assert seen and seen <= allowed


def test_a_saved_artifact_reloads_to_identical_drafts(model, trained, tmp_path):
    artifact, _ = trained
    path = tmp_path / "head.pt"
    artifact.save(path)
    reloaded = EagleArtifact.load(path, model)
    assert torch.equal(reloaded.vocab, artifact.vocab)
    drafts = []
    for a in (EagleArtifact(reloaded.head_state, artifact.vocab, artifact.fingerprint), reloaded):
        drafter = EagleDrafter(EagleModel(model, a), 4, 3, 6, 0.0)
        prompt = PROMPTS[0]
        with torch.inference_mode():
            hidden = model.hidden(torch.tensor(prompt), torch.arange(len(prompt)), model.new_cache(len(prompt)))
            drafter.reset(prompt, None)
            drafter.observe(hidden)
            drafts.append(drafter.propose(prompt + [5], 4))
    assert drafts[0] == drafts[1] and len(drafts[0]) == 6


def test_an_artifact_for_another_model_is_refused(model, tmp_path):
    path = tmp_path / "head.pt"
    random_artifact(model).save(path)
    with pytest.raises(ValueError, match="another model"):
        EagleArtifact.load(path, tiny_model(seed=4))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a specee EAGLE drafter"):
        EagleArtifact.load(tmp_path / "junk.pt", model)
