"""The EAGLE-style feature head on tiny random models: exact greedy output, the reduced
vocabulary, artifacts (reload, refusal for another model) and training."""
import pytest
import torch
import torch.nn.functional as F

from helpers import tiny_model
from specee.drafters.eagle import EagleArtifact, EagleDrafter, EagleHead, EagleModel, merge_path, DraftNode
from specee.drafters.prompt_lookup import PromptLookup
from specee.model.fingerprint import weights_fingerprint
from specee.sampling import Sampler, SamplingParams
from specee.stats import GenerationStats
from specee.strategies.base import DecodeState
from specee.strategies.dense import Autoregressive
from specee.strategies.speculative import Speculative
from specee.train.collect import choose_vocabulary, collect
from specee.train.eagle import EagleTrainConfig, fit_head, unrolled_estimates

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
        for step in strategy.decode(state):
            out += step.tokens
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


@pytest.mark.parametrize("copy_alone", [0.0, 1.0])
def test_greedy_eagle_copy_equals_dense(model, trained, monkeypatch, copy_alone):
    """The copy mixed into the head's tree (copy_alone 1) or drafted alone without a head pass
    wherever there is one (copy_alone 0): greedy output stays dense decoding's."""
    artifact, _ = trained
    eagle = EagleModel(model, artifact)
    head_passes_per_step = []
    run, propose = EagleDrafter._run, EagleDrafter.propose

    def counted_run(self, *args):
        head_passes_per_step[-1] += 1
        return run(self, *args)

    def counted_propose(self, *args):
        head_passes_per_step.append(0)
        return propose(self, *args)

    monkeypatch.setattr(EagleDrafter, "_run", counted_run)
    monkeypatch.setattr(EagleDrafter, "propose", counted_propose)
    for prompt in PROMPTS:
        dense, _ = decode(model, Autoregressive(), prompt)
        strategy = Speculative(lambda: EagleDrafter(eagle, 4, 3, 6, 0.0, PromptLookup(num_draft_tokens=6), copy_alone),
                               6, tree_budget=6, tree_width=3, adaptive=False)
        assert decode(model, strategy, prompt)[0] == dense
    skipped = head_passes_per_step.count(0)  # steps that drafted the copy alone
    assert (0 < skipped < len(head_passes_per_step)) if copy_alone == 0.0 else skipped == 0


def test_a_copied_path_merges_into_the_tree():
    nodes = [DraftNode(10, -1, 1, -0.1), DraftNode(11, -1, 1, -2.0), DraftNode(20, 0, 2, -1.5)]
    merge_path(nodes, [10, 21, 30], -0.5)
    assert [(n.token, n.parent, n.depth) for n in nodes[3:]] == [(21, 0, 2), (30, 3, 3)]
    assert nodes[0].score == -0.1 and nodes[3].score == -1.0 and nodes[4].score == -1.5
    merge_path(nodes, [11], -0.5)  # a node the tree has: the better score, no new node
    assert len(nodes) == 5 and nodes[1].score == -0.5


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


def test_unrolled_training_sees_what_drafting_sees(model):
    """Training's level k reads and attends to what a draft node k - 1 below the root does: fed
    the drafter's own chain, each level's top choice is the drafter's next draft token."""
    artifact = random_artifact(model, seed=5)
    eagle = EagleModel(model, artifact)
    head = EagleHead(model.config)
    head.load_state_dict(artifact.weights)
    depth, prompt, root = 4, PROMPTS[0], 5
    with torch.inference_mode():
        states = model.hidden(torch.tensor(prompt), torch.arange(len(prompt)), model.new_cache(len(prompt)))
        drafter = EagleDrafter(eagle, depth, 1, depth, 0.0)  # width 1: a chain of its top choices
        drafter.reset(prompt, None)
        drafter.observe(states)
        chain = drafter.propose(prompt + [root], depth).tokens
        ids = torch.tensor(prompt + [root] + chain)
        # Training reads the target's states only up to the root's parent; the rest are never seen.
        padded = torch.cat((states, torch.full((len(ids) - len(prompt), states.shape[1]), 1e3)))
        P = len(prompt)
        picks = [int(eagle.vocab[eagle.log_probs(estimate[P - 1:P]).argmax()])
                 for k, estimate in unrolled_estimates(head, model, ids, padded, depth)]
    assert len(chain) == depth and len(set(chain)) > 1
    assert picks == chain


def test_unrolled_training_drafts_deeper_levels_better(model):
    """Trained on its own estimates (training-time test), the head's third draft level agrees
    with the model far more often than after the same steps of teacher-forced training only."""
    data = collect(model, own_continuations(model, count=12))
    vocab, _ = choose_vocabulary(data.top_counts, 1.0)
    scorer = model.head_rows(vocab).float()

    def third_level_agreement(unroll: int) -> float:
        cfg = EagleTrainConfig(epochs=12, lr=3e-3, warmup_steps=10, unroll=unroll, held_out=0.0)
        head, figures = fit_head(model, data, vocab, cfg)
        assert figures["final_loss"] < 0.85 * figures["first_loss"]
        agree = []
        with torch.no_grad():
            for ids, states in zip(data.ids, data.states):
                estimate = dict(unrolled_estimates(head, model, ids, states.float(), 3))[3]
                drafted = F.linear(model.norm(estimate), scorer).argmax(-1)
                agree.append(drafted == F.linear(model.norm(states[3:].float()), scorer).argmax(-1))
        return float(torch.cat(agree).float().mean())

    assert third_level_agreement(unroll=3) > 2 * third_level_agreement(unroll=1) + 0.05


def test_a_saved_artifact_reloads_to_identical_drafts(model, trained, tmp_path):
    artifact, _ = trained
    path = tmp_path / "head.pt"
    artifact.save(path)
    reloaded = EagleArtifact.load(path, model)
    assert torch.equal(reloaded.vocab, artifact.vocab)
    drafts = []
    for a in (EagleArtifact(reloaded.weights, artifact.vocab, artifact.fingerprint), reloaded):
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


def test_collected_states_keep_values_beyond_fp16s_range():
    """Gemma's residual stream reaches past fp16's 65,504: such states are kept (in bf16), not inf."""
    model = tiny_model(seed=3)
    with torch.no_grad():
        model.embed_tokens.weight.mul_(1e6)
    data = collect(model, [[1, 2, 3, 4, 5]])
    assert torch.isfinite(data.states[0]).all() and data.states[0].float().abs().max() > 65504
    assert collect(tiny_model(seed=3), [[1, 2, 3]]).states[0].dtype == torch.float16  # fp16 where it fits
