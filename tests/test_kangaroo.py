"""The Kangaroo adapter on tiny random models: exact greedy output, the shared shallow-layer cache
and the adapter's own cache, the reduced vocabulary, artifacts and training."""
import pytest
import torch

from helpers import decode, tiny_model
from specee.drafters.kangaroo import Adapter, KangarooArtifact, KangarooDrafter, KangarooModel, KangarooSettings
from specee.drafters.trained import drafter_cache
from specee.model.fingerprint import weights_fingerprint
from specee.strategies.dense import Autoregressive
from specee.strategies.speculative import Speculative
from specee.train.collect import choose_vocabulary, collect
from specee.train.kangaroo import KangarooTrainConfig, fit_adapter

VOCAB = 97
LAYERS = 4  # the tiny model's depth here; the drafter shares the first SHALLOW
SHALLOW = 1
PROMPTS = [[3, 14, 15, 92, 65, 35], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [50, 60, 70], [7] * 12]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, num_hidden_layers=LAYERS)


def random_artifact(model, vocab=None, seed=0, settings=None) -> KangarooArtifact:
    torch.manual_seed(seed)
    vocab = torch.arange(VOCAB) if vocab is None else vocab
    return KangarooArtifact(Adapter(model.config).state_dict(), vocab, weights_fingerprint(model),
                            settings or KangarooSettings(SHALLOW, 0.0, 4))


def kangaroo_strategy(model, artifact, eta=0.0, gamma=4):
    kangaroo = KangarooModel(model, artifact)
    return Speculative(lambda: KangarooDrafter(kangaroo, eta, gamma), gamma, adaptive=False, name="kangaroo",
                       shallow_layers=artifact.settings.layers)


def own_continuations(model, count=24, length=60) -> list[list[int]]:
    """The tiny model's own greedy continuations of random starts: what an adapter learns from."""
    chunks = []
    for seed in range(count):
        start = torch.randint(0, VOCAB, (4,), generator=torch.Generator().manual_seed(seed)).tolist()
        chunks.append(start + decode(model, Autoregressive(), start, steps=length)[0])
    return chunks


def fit(model, epochs: int):
    data = collect(model, own_continuations(model))
    vocab, _ = choose_vocabulary(data.top_counts, 1.0)
    cfg = KangarooTrainConfig(epochs=epochs, lr=1e-2, warmup_steps=10, held_out=0.25)
    adapter, figures = fit_adapter(model, data, vocab, SHALLOW, cfg)
    return KangarooArtifact(adapter.state_dict(), vocab, weights_fingerprint(model),
                            KangarooSettings(SHALLOW, 0.0, 4)), figures


@pytest.fixture(scope="module")
def trained(model):
    """(artifact, training figures) of an adapter trained on the model's own text."""
    return fit(model, epochs=15)


def test_training_lowers_the_loss_and_learns_the_model(model, trained):
    _, figures = trained
    _, untrained = fit(model, epochs=0)
    assert figures["steps"] > 100
    # Soft cross-entropy against the target's distribution: its entropy is the floor.
    assert figures["final_loss"] < figures["first_loss"] - 0.3
    assert figures["held_out_top1_agreement"] > untrained["held_out_top1_agreement"] + 0.03


@pytest.mark.parametrize("eta", [0.0, 0.5])
def test_greedy_kangaroo_equals_dense(model, trained, eta):
    artifact, _ = trained
    proposed = accepted = 0
    for artifact_under_test in (artifact, random_artifact(model)):  # a trained and an untrained adapter
        for prompt in PROMPTS:
            dense, _, _ = decode(model, Autoregressive(), prompt)
            drafted, stats, _ = decode(model, kangaroo_strategy(model, artifact_under_test, eta), prompt)
            assert drafted == dense
            proposed += stats.draft_tokens_proposed
            accepted += stats.draft_tokens_accepted
    assert 0 < accepted < proposed


def test_deeper_shared_layers_stay_exact(model):
    artifact = random_artifact(model, settings=KangarooSettings(3, 0.0, 3))
    for prompt in PROMPTS:
        assert decode(model, kangaroo_strategy(model, artifact, gamma=3), prompt)[0] == \
            decode(model, Autoregressive(), prompt)[0]


def test_the_shared_cache_equals_a_full_forward(model, trained):
    """After drafting through the shared shallow layers and verifying from layer l, every layer's
    cache holds exactly the committed tokens, with what one full forward over them writes."""
    artifact, _ = trained
    for prompt in PROMPTS:
        out, stats, cache = decode(model, kangaroo_strategy(model, artifact), prompt, steps=40)
        assert stats.draft_tokens_accepted > 0
        committed = prompt + out[:cache.length - len(prompt)]
        assert cache.lengths == [len(committed)] * LAYERS
        with torch.inference_mode():
            full = model.new_cache(len(committed))
            model.hidden(torch.tensor(committed), torch.arange(len(committed)), full)
        n = len(committed)
        torch.testing.assert_close(cache.keys[:, :, :n], full.keys[:, :, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cache.values[:, :, :n], full.values[:, :, :n], atol=1e-4, rtol=1e-4)


def test_the_adapter_cache_is_filled_after_fully_accepted_drafts(model, trained, monkeypatch):
    """The adapter never sees the last draft token; when the whole draft is accepted its entry is
    filled at the next step, so the adapter's cache always equals one pass over the committed
    shallow states."""
    artifact, _ = trained
    kangaroo = KangarooModel(model, artifact)
    checked, full_steps = [0], [0]
    update = KangarooDrafter.update

    def checked_update(self, context, num_accepted):
        update(self, context, num_accepted)
        full_steps[0] += num_accepted == len(self.last[1]) - 1
        # The next step feeds the pending states; after it the cache must match a pass over all of them.
        committed = context[:self.fed + len(self.pending)]
        with torch.inference_mode():
            shallow = model.hidden(torch.tensor(committed), torch.arange(len(committed)), model.new_cache(len(committed)),
                                   layers=range(SHALLOW))
            reference = drafter_cache(model, len(committed))
            kangaroo.adapter(shallow, model.angles(torch.arange(len(committed))), reference)
        n = self.fed
        assert self.adapter_cache.lengths == [n]
        torch.testing.assert_close(self.adapter_cache.keys[:, :, :n], reference.keys[:, :, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(self.pending, shallow[n:], atol=1e-4, rtol=1e-4)
        checked[0] += 1

    monkeypatch.setattr(KangarooDrafter, "update", checked_update)
    for prompt in PROMPTS:
        decode(model, kangaroo_strategy(model, artifact, gamma=2), prompt)
    assert checked[0] > 10 and full_steps[0] > 0


def test_reduced_vocabulary_never_drafts_outside_it(model, monkeypatch):
    vocab = torch.arange(0, VOCAB, 3)  # a third of the tokens
    artifact = random_artifact(model, vocab)
    seen = set()
    original = KangarooDrafter.propose

    def recorded(self, context, max_tokens):
        draft = original(self, context, max_tokens)
        seen.update(draft.tokens)
        return draft

    monkeypatch.setattr(KangarooDrafter, "propose", recorded)
    for prompt in PROMPTS:
        assert decode(model, kangaroo_strategy(model, artifact), prompt)[0] == decode(model, Autoregressive(), prompt)[0]
    assert seen and seen <= set(vocab.tolist())


def test_drafting_stops_after_the_first_unconfident_token(model, trained):
    """eta 1: every draft is one token (the low-confidence token stays); eta 0: always gamma."""
    artifact, _ = trained
    for eta, length in ((1.0, 1), (0.0, 4)):
        _, stats, _ = decode(model, kangaroo_strategy(model, artifact, eta=eta, gamma=4), PROMPTS[1], steps=20)
        assert stats.position_proposed == [stats.target_passes] * length


def test_a_saved_artifact_reloads_to_identical_drafts(model, trained, tmp_path):
    artifact, _ = trained
    path = tmp_path / "adapter.pt"
    artifact.save(path)
    reloaded = KangarooArtifact.load(path, model)
    assert torch.equal(reloaded.vocab, artifact.vocab) and reloaded.settings == artifact.settings
    runs = [decode(model, kangaroo_strategy(model, a), PROMPTS[0])[1] for a in (artifact, reloaded)]
    assert runs[0].accept_lengths == runs[1].accept_lengths


def test_an_artifact_for_another_model_is_refused(model, tmp_path):
    path = tmp_path / "adapter.pt"
    random_artifact(model).save(path)
    with pytest.raises(ValueError, match="another model"):
        KangarooArtifact.load(path, tiny_model(seed=4, num_hidden_layers=LAYERS))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a specee Kangaroo drafter"):
        KangarooArtifact.load(tmp_path / "junk.pt", model)
    with pytest.raises(ValueError, match="shallow layers: the model has 4"):
        KangarooModel(model, random_artifact(model, settings=KangarooSettings(LAYERS, 0.5, 4)))
