"""Early exit (SpecEE) on tiny random models: features against a slow reference, the exact and
approximate KV of skipped layers, thresholds that never fire reproduce dense decoding, the layer
scheduler, predictor training and artifacts."""
import random

import pytest
import torch

from helpers import decode, tiny_model
from specee.drafters.draft_model import DraftModel
from specee.drafters.kangaroo import Adapter, KangarooArtifact, KangarooDrafter, KangarooModel, KangarooSettings
from specee.drafters.prompt_lookup import PromptLookup
from specee.engine import Engine
from specee.eval.teacher_forcing import teacher_forced
from specee.exits.candidates import Candidates
from specee.exits.features import layer_features
from specee.exits.policy import LearnedExit, RuleExit, RuleSettings
from specee.exits.predictors import ExitArtifact, ExitPredictors, ExitSettings
from specee.exits.scheduler import LayerScheduler
from specee.model.fingerprint import weights_fingerprint
from specee.sampling import Sampler, SamplingParams
from specee.stats import GenerationStats
from specee.strategies.base import DecodeState
from specee.strategies.dense import Autoregressive
from specee.strategies.early_exit import EarlyExit
from specee.strategies.exit_pass import ExitPass
from specee.strategies.speculative import Speculative
from specee.strategies.speculative_exit import SpeculativeExit
from specee.train.exits import ExitTrainConfig, collect_exit_data, fit_predictors, replay_exits
from specee.verification.tree import static_tree

VOCAB = 97
LAYERS = 6
KANGAROO_LAYERS = 2  # the Kangaroo drafter here shares the model's first 2 layers
PROMPTS = [[3, 14, 15, 92, 65, 35, 3, 14], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [50, 60, 70], [7] * 12]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1, num_hidden_layers=LAYERS)


class ExitAt:
    """A policy that asks to exit after a seeded random choice of layers (the full-head check
    still decides), so exits land at many depths."""

    def __init__(self, seed: int, rate: float = 0.4) -> None:
        self.random = random.Random(seed)
        self.rate = rate

    def active(self):
        return [True] * (LAYERS - 1)

    def fires(self, layer, features, probs, drafter_probs):
        return torch.tensor([self.random.random() < self.rate for _ in range(len(features))])

    def confirms(self, logits, first, drafter_probs):
        return torch.ones(len(logits), dtype=torch.bool)

    def exited(self, layer):
        pass


def exit_when_fired(layer, fired, check):
    """A one-row pass's settle rule when every check agrees: the row exits wherever its policy fires."""
    return ([0], check([0])[0]) if fired[0] else None


def one_token(runner, token, rows):
    """Feed `token` alone with candidates `rows` [K]: the pass's (logits [1, vocab], layers run)."""
    result = runner.run([token], rows[None], torch.zeros(1), exit_when_fired)
    return result.logits, result.layers


def candidates(k=4, everything=False):
    """Prompt lookup's guesses; with `everything`, the whole vocabulary (every check passes)."""
    k = VOCAB if everything else k
    return Candidates(lambda: PromptLookup(), list(range(VOCAB)), k)


def random_artifact(model, seed=0, settings=None):
    torch.manual_seed(seed)
    predictors = ExitPredictors(LAYERS - 1, 12)
    return ExitArtifact(predictors.state_dict(), torch.arange(4), weights_fingerprint(model),
                        settings or ExitSettings(layers=[2, 3]))


def test_features_equal_a_slow_reference(model):
    """The features decoding computes for a token after each layer equal those from the full
    head's logits of the candidates, layer by layer, in a separate full pass."""
    prompt = PROMPTS[0]
    seen = {}
    token, rows = 5, torch.tensor([3, 14, 40, 77])
    with torch.inference_mode():
        cache = model.new_cache(32)
        model(torch.tensor(prompt), torch.arange(len(prompt)), cache)
        policy = RuleExit(RuleSettings(2.0, 2.0, first_layer=0), LAYERS - 1)  # decides everywhere, never exits
        one_token(ExitPass(model, cache, policy, "exact", GenerationStats(), lambda i, f: seen.__setitem__(i, f)), token,
                  rows)
        # Slow reference: every state of a full pass, the full head, the candidates' columns.
        ref_cache = model.new_cache(32)
        model(torch.tensor(prompt), torch.arange(len(prompt)), ref_cache)
        h = model.embed(torch.tensor([token]))
        states = [h]
        for i in range(LAYERS):
            h = model.run_layers(h, torch.tensor([len(prompt)]), ref_cache, layers=range(i, i + 1))
            states.append(h)
        reference = []
        for i in range(1, LAYERS):
            logits = model.logits(model.norm(states[i]))[0, rows]
            below = model.logits(model.norm(states[i - 1]))[0, rows].softmax(-1)
            probs = logits.softmax(-1)
            reference.append(torch.cat((logits, probs, probs - below)))
        batched = layer_features(model, states, model.head_rows(rows)[None])[0]  # training's batched path
    assert sorted(seen) == list(range(LAYERS - 1))
    for i in range(LAYERS - 1):
        torch.testing.assert_close(seen[i][0], reference[i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batched[i], reference[i], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv", ["exact", "approx"])
def test_thresholds_that_never_fire_reproduce_dense(model, kv):
    artifact = random_artifact(model, settings=ExitSettings(layers=list(range(LAYERS - 1))))
    predictors = artifact.predictors()
    never = [EarlyExit(candidates(), lambda: LearnedExit(predictors, artifact.settings, 1.01), kv),
             EarlyExit(candidates(), lambda: RuleExit(RuleSettings(1.01, 1.01, first_layer=0), LAYERS - 1), kv)]
    for prompt in PROMPTS:
        dense, _, _ = decode(model, Autoregressive(), prompt, steps=40)
        for strategy in never:
            out, stats, cache = decode(model, strategy, prompt, steps=40)
            assert out == dense
            assert stats.exit_layers == [LAYERS] * (len(out) - 1) and stats.predictors_run > 0
            assert len(set(cache.lengths)) == 1


def dense_cache(model, ids):
    cache = model.new_cache(len(ids) + 4)
    with torch.inference_mode():
        model(torch.tensor(ids), torch.arange(len(ids)), cache)
    return cache


def checked_steps(model, strategy, prompt, steps):
    """Decode `steps` steps; after each, every layer's filled part must equal what full passes over
    the committed tokens write, and a layer may lack only positions the layers under it hold.
    Returns (how many steps ended with some layer lagging, the run's stats)."""
    lagged = 0
    with torch.inference_mode():
        cache = model.new_cache(128)
        logits, hidden, shallow = model.prefill(prompt, cache, getattr(strategy, "shallow_layers", None))
        state = DecodeState(model, cache, list(prompt), logits, Sampler(SamplingParams()), GenerationStats(), hidden,
                            shallow)
        decoding = strategy.decode(state)
        for _ in range(steps):
            next(decoding)
            fed = state.tokens[:-1]  # the token just yielded is fed at the next step
            assert cache.lengths[0] == len(fed)
            assert all(a >= b for a, b in zip(cache.lengths, cache.lengths[1:]))
            lagged += any(n < len(fed) for n in cache.lengths)
            reference = dense_cache(model, fed)
            for layer, n in enumerate(cache.lengths):
                # Within float rounding: batches of other shapes round differently.
                for held, full in ((cache.keys, reference.keys), (cache.values, reference.values)):
                    torch.testing.assert_close(held[layer, :, :n], full[layer, :, :n], rtol=1e-4, atol=1e-4)
    return lagged, state.stats


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_kv_equals_full_passes_for_the_emitted_tokens(model, seed):
    """Exits at random depths in plain decoding: the cache stays what full passes write."""
    lagged, stats = checked_steps(model, EarlyExit(candidates(everything=True), lambda: ExitAt(seed), "exact"),
                                  PROMPTS[seed], 25)
    assert lagged >= 5 and min(stats.exit_layers) < LAYERS


def test_exact_kv_catches_up_so_a_full_pass_equals_dense(model):
    """After exits, a token that runs the whole depth sees exactly the dense model's cache: its
    logits equal a dense pass's over the same tokens, and every layer is full again."""
    prompt, fed = PROMPTS[1], [5, 17, 5, 17, 33, 2, 9, 5, 17, 60, 61, 62]
    stats = GenerationStats()
    with torch.inference_mode():
        cache = model.new_cache(64)
        model(torch.tensor(prompt), torch.arange(len(prompt)), cache)
        runner = ExitPass(model, cache, ExitAt(7, rate=0.5), "exact", stats)
        for token in fed:
            one_token(runner, token, torch.arange(VOCAB))
        assert cache.deferred.positions and any(n < len(prompt + fed) for n in cache.lengths)  # layers lag now
        runner.policy = RuleExit(RuleSettings(2.0, 2.0), LAYERS - 1)  # never exits
        logits, layers = one_token(runner, 99 % VOCAB, torch.arange(4))
        tokens = prompt + fed + [99 % VOCAB]
        reference = model(torch.tensor(tokens), torch.arange(len(tokens)), model.new_cache(64))[-1:]
    assert layers == LAYERS and set(cache.lengths) == {len(tokens)} and not cache.deferred.positions
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)


def test_approximate_kv_fills_every_layer_at_once(model):
    strategy = EarlyExit(candidates(everything=True), lambda: ExitAt(3, rate=0.5), "approx")
    prompt = PROMPTS[0]
    out, stats, cache = decode(model, strategy, prompt, steps=20)
    fed = prompt + out[:-1]
    assert min(stats.exit_layers) < LAYERS
    assert cache.lengths == [len(fed)] * LAYERS  # no holes, no drift
    reference = dense_cache(model, fed)
    torch.testing.assert_close(cache.keys[0, :, :len(fed)], reference.keys[0, :, :len(fed)], rtol=1e-5, atol=1e-5)
    # Deeper layers hold approximations where tokens exited: not the full passes' values.
    assert not torch.allclose(cache.keys[LAYERS - 1, :, :len(fed)], reference.keys[LAYERS - 1, :, :len(fed)], atol=1e-3)


def test_an_exit_emits_the_exit_layers_argmax_and_counts_it(model):
    """With a policy that always asks, the first decision layer whose full-head argmax is a
    candidate ends the pass, and the stats count what ran."""
    strategy = EarlyExit(candidates(everything=True), lambda: ExitAt(0, rate=1.0), "exact")
    out, stats, _ = decode(model, strategy, PROMPTS[2], steps=10)
    assert stats.exit_layers == [1] * 9  # layer 0's argmax is always among all tokens
    assert stats.exit_checks == stats.exit_checks_agreed == stats.predictors_run == 9
    assert stats.avg_forward_layers == 1 and stats.exit_histogram == {1: 9}


@pytest.mark.parametrize("offline,recent,expected", [
    ([3], [], {3}),
    ([3], [10], {3, 8, 9, 10, 11, 12}),
    ([], [0, 1], {0, 1, 2, 3}),
    ([5], [13, 13], {5, 11, 12, 13}),  # clipped at the last layer with a predictor (13)
])
def test_scheduler_layer_sets(offline, recent, expected):
    scheduler = LayerScheduler(offline, num_layers=14, window=5, radius=2)
    for layer in recent:
        scheduler.record(layer)
    assert {i for i, on in enumerate(scheduler.active()) if on} == expected


def test_scheduler_forgets_exits_beyond_its_window():
    scheduler = LayerScheduler([], num_layers=20, window=2, radius=1)
    for layer in (5, 10, 15):
        scheduler.record(layer)
    assert {i for i, on in enumerate(scheduler.active()) if on} == {9, 10, 11, 14, 15, 16}


def test_trained_predictors_beat_chance_on_held_out_data(model):
    """Predictors trained on the tiny model's own exit labels rank held-out positives above
    negatives (AUC: 0.5 is chance)."""
    generator = random.Random(0)
    motifs = [[generator.randrange(VOCAB) for _ in range(5)] for _ in range(6)]
    chunks = [[t for _ in range(12) for t in generator.choice(motifs)] for _ in range(24)]
    data = collect_exit_data(model, candidates(), chunks)
    rows = torch.arange(len(data.labels))
    held = data.chunk_of >= 20
    module, figures = fit_predictors(data, rows[~held], ExitTrainConfig(epochs=40, batch=256, minutes=1, lr=3e-3))
    with torch.no_grad():
        probs = torch.sigmoid(module(data.features[held]))
    labels = data.labels[held]
    positives, negatives = probs[labels], probs[~labels]
    auc = (positives[:, None] > negatives[None, :]).float().mean()
    assert figures["final_loss"] < figures["first_loss"]
    assert auc > 0.65, auc  # measured 0.72
    replay = replay_exits(probs, data.in_candidates[held], labels, 0.5)
    assert 0 < replay["exit_rate"] and replay["avg_layers"] < LAYERS


def test_replay_takes_the_first_firing_candidate_layer():
    probs = torch.tensor([[0.9, 0.9, 0.1], [0.1, 0.2, 0.3], [0.1, 0.8, 0.9]])
    in_candidates = torch.tensor([[False, True, True], [True, True, True], [True, True, True]])
    labels = torch.tensor([[False, True, True], [False, False, True], [False, False, True]])
    replay = replay_exits(probs, in_candidates, labels, 0.5)
    # Exits: token 0 after layer 1 (layer 0 is not a candidate), token 2 after layer 1 (wrong).
    assert replay["exit_rate"] == pytest.approx(2 / 3) and replay["fidelity"] == pytest.approx(0.5)
    assert replay["per_layer"] == [0, 2, 0] and replay["avg_layers"] == pytest.approx((2 + 4 + 2) / 3)


def test_artifact_round_trip_and_wrong_model_is_refused(model, tmp_path):
    artifact = random_artifact(model, settings=ExitSettings(threshold=0.7, layers=[1, 4]))
    path = tmp_path / "exits.pt"
    artifact.save(path)
    loaded = ExitArtifact.load(path, model)
    assert loaded.settings == artifact.settings
    features = torch.randn(3, 12)
    torch.testing.assert_close(loaded.predictors().layer(2, features), artifact.predictors().layer(2, features),
                               rtol=1e-2, atol=1e-3)  # stored in fp16
    with pytest.raises(ValueError, match="trained for another model"):
        ExitArtifact.load(path, tiny_model(seed=9, num_hidden_layers=LAYERS))


def test_rule_settings_are_checked():
    with pytest.raises(ValueError, match="must not exceed p1"):
        RuleSettings(0.5, 0.8).check()
    with pytest.raises(ValueError, match="must be in"):
        RuleSettings(0.8, -0.1).check()


def test_rule_lowers_the_bar_for_the_draft_token():
    rule = RuleExit(RuleSettings(0.8, 0.5, first_layer=0), 4)
    rows = torch.tensor([[0.55, 0.25, 0.1, 0.1],  # the draft token leads: over p2
                         [0.2, 0.6, 0.1, 0.1],  # another candidate leads, under p1
                         [0.05, 0.85, 0.05, 0.05]])  # another candidate over p1
    assert rule.fires(0, None, rows, torch.zeros(3)).tolist() == [True, False, True]
    weighted = RuleExit(RuleSettings(0.8, 0.5, draft_weight=0.5, first_layer=0), 4)
    assert weighted.fires(0, None, rows[:1].expand(2, 4), torch.tensor([0.0, 0.9])).tolist() == [False, True]


def test_the_rule_is_decided_over_the_full_vocabulary():
    rule = RuleExit(RuleSettings(0.8, 0.5, first_layer=0), 4)
    logits = torch.zeros(3, 10)
    logits[0, 3], logits[1, 3], logits[2, 3] = 5.0, 3.0, 2.0  # token 3 has 0.94, 0.69, 0.45 of the vocabulary
    assert rule.confirms(logits, torch.tensor([0, 3, 3]), torch.zeros(3)).tolist() == [True, True, False]
    assert rule.confirms(logits, torch.tensor([0, 0, 3]), torch.zeros(3)).tolist() == [True, False, False]


def test_the_rules_candidate_step_never_drops_an_exit_the_full_head_would_confirm():
    """A candidate's share of K is at least its share of the vocabulary, so every row whose full
    softmax passes (with its argmax among the candidates, as an exit needs) passed the first step."""
    torch.manual_seed(0)
    logits = torch.randn(400, 50) * 4
    top = logits.argmax(-1).tolist()
    # Distinct candidates, as decoding's; half the rows have the argmax as their draft token.
    rows = torch.stack([torch.tensor(([top[i]] if i % 2 == 0 else [])
                                     + [t for t in torch.randperm(50).tolist() if t != top[i]][: 4 - (i % 2 == 0)])
                        for i in range(400)])
    rule = RuleExit(RuleSettings(0.8, 0.5, draft_weight=0.3, first_layer=0), 4)
    drafter = torch.rand(400)
    fired = rule.fires(0, None, logits.gather(-1, rows).softmax(-1), drafter)
    confirmed = rule.confirms(logits, rows[:, 0], drafter) & (logits.argmax(-1)[:, None] == rows).any(-1)
    assert confirmed.sum() > 20 and (fired | ~confirmed).all() and (fired & ~confirmed).any()


TREE = static_tree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])  # the greedy path is rows 0, 1, 3, 5


def verified_exit(policy, kind="chain", kv="exact", everything=False, model=None):
    """Exits inside the verification of: prompt-lookup chains ("chain"); trees drafted by the
    model's first layer ("tree"); Kangaroo chains over the model's first 2 layers ("kangaroo")."""
    if kind == "chain":
        speculative = Speculative(lambda: PromptLookup(), num_draft_tokens=4)
    elif kind == "tree":
        speculative = Speculative(lambda: DraftModel(model, 1), tree=TREE, num_draft_tokens=3)
    else:
        torch.manual_seed(0)
        artifact = KangarooArtifact(Adapter(model.config).state_dict(), torch.arange(VOCAB), weights_fingerprint(model),
                                    KangarooSettings(KANGAROO_LAYERS, 0.0, 4))
        kangaroo = KangarooModel(model, artifact)
        speculative = Speculative(lambda: KangarooDrafter(kangaroo, 0.0, 4), 4, adaptive=False,
                                  shallow_layers=KANGAROO_LAYERS)
    return SpeculativeExit(speculative, candidates(everything=everything), policy, kv)


def shallow_greedy(model, prompt, steps, layers=1):
    """The first token from the full model (prefill), then greedy decoding of the model cut after
    its first `layers` layers (their norm and head)."""
    with torch.inference_mode():
        cache = model.new_cache(len(prompt) + steps + 4)
        tokens = list(prompt) + [int(model(torch.tensor(prompt), torch.arange(len(prompt)), cache)[-1].argmax())]
        for _ in range(steps - 1):
            h = model.hidden(torch.tensor(tokens[-1:]), torch.tensor([len(tokens) - 1]), cache, layers=range(layers))
            tokens.append(int(model.logits(model.norm(h)).argmax(-1)))
    return tokens[len(prompt):]


@pytest.mark.parametrize("kind", ["plain", "chain", "tree", "kangaroo"])
def test_always_exiting_at_the_first_decision_decodes_the_cut_model(model, kind):
    """When every row's policy fires and every token is a candidate, each pass settles at its
    first decision layer (after layer 0; after the shared layers' first above them for Kangaroo),
    and (exact KV keeps the layers up to it complete) the output is greedy decoding of the model
    cut there: the acceptance of exited chains and tree paths is checked against an independent
    loop."""
    always = lambda: ExitAt(0, rate=1.0)  # noqa: E731
    strategy = (EarlyExit(candidates(everything=True), always) if kind == "plain"
                else verified_exit(always, kind, everything=True, model=model))
    cut = KANGAROO_LAYERS + 1 if kind == "kangaroo" else 1
    accepted = 0
    for prompt in PROMPTS:
        out, stats, _ = decode(model, strategy, prompt, steps=24)
        assert out == shallow_greedy(model, prompt, 24, cut)
        assert set(stats.exit_layers) == {cut}
        accepted += stats.draft_tokens_accepted
    assert kind == "plain" or accepted > 0


@pytest.mark.parametrize("kind", ["chain", "tree", "kangaroo"])
@pytest.mark.parametrize("kv", ["exact", "approx"])
def test_verification_exits_that_never_fire_reproduce_dense(model, kind, kv):
    artifact = random_artifact(model, settings=ExitSettings(layers=list(range(LAYERS - 1))))
    predictors = artifact.predictors()
    strategy = verified_exit(lambda: LearnedExit(predictors, artifact.settings, 1.01), kind, kv, model=model)
    accepted = 0
    for prompt in PROMPTS:
        dense, _, _ = decode(model, Autoregressive(), prompt, steps=40)
        out, stats, cache = decode(model, strategy, prompt, steps=40)
        assert out == dense and set(stats.exit_layers) == {LAYERS}
        accepted += stats.draft_tokens_accepted
    assert accepted > 0


@pytest.mark.parametrize("kind,seed", [("chain", 0), ("chain", 3), ("tree", 0), ("tree", 3), ("kangaroo", 1)])
def test_verification_exits_keep_the_exact_kv_of_the_accepted_path(model, kind, seed):
    """Chains and trees verified with exits at random depths: the cache stays what full passes
    over the committed tokens write; rejected rows are forgotten in every layer (a tree's accepted
    path moves next to the prefix in the layers that hold it, lagging layers untouched)."""
    strategy = verified_exit(lambda: ExitAt(seed, rate=0.3), kind, everything=True, model=model)
    lagged, stats = checked_steps(model, strategy, PROMPTS[1], 20)
    assert lagged >= 3 and stats.draft_tokens_proposed > 0 and min(stats.exit_layers) < LAYERS
    assert kind != "tree" or stats.draft_tokens_accepted > 0  # accepted paths moved next to the prefix


def test_verification_exits_refuse_sampling(model, tiny_tokenizer):
    engine = Engine(model, tiny_tokenizer)
    with pytest.raises(ValueError, match="greedy only"):
        engine.generate(PROMPTS[0], strategy=verified_exit(lambda: ExitAt(0)), temperature=0.7, seed=1)




def exit_strategy(policy, kind, everything=False, model=None):
    """Exits in plain decoding ("plain"), or inside verification (`verified_exit`'s kinds)."""
    if kind == "plain":
        return EarlyExit(candidates(everything=everything), policy)
    return verified_exit(policy, kind, everything=everything, model=model)


@pytest.mark.parametrize("kind", ["plain", "chain", "tree", "kangaroo"])
def test_teacher_forcing_scores_where_each_pass_settled(model, kind):
    """Teacher forcing gives each position the logits where its pass settled (a verification
    mode's root row): the dense model's when no policy fires; the cut model's when every row exits
    at the first decision."""
    ids = [5, 9, 14, 5, 9, 14, 5, 9, 30, 31, 5, 9, 14, 5, 60, 61]
    prefix = 4
    with torch.inference_mode():
        dense = model(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(32))[prefix:-1]
        cut = KANGAROO_LAYERS + 1 if kind == "kangaroo" else 1
        h = model.hidden(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(32), layers=range(cut))
        shallow = model.logits(model.norm(h))[prefix:-1]
    never = exit_strategy(lambda: RuleExit(RuleSettings(1.01, 1.01, first_layer=0), LAYERS - 1), kind, model=model)
    logits, stats = teacher_forced(never, model, ids, prefix)
    torch.testing.assert_close(logits, dense, rtol=1e-4, atol=1e-4)
    assert stats.exit_layers == [LAYERS] * len(dense)
    always = exit_strategy(lambda: ExitAt(0, rate=1.0), kind, everything=True, model=model)
    logits, stats = teacher_forced(always, model, ids, prefix)
    torch.testing.assert_close(logits, shallow, rtol=1e-4, atol=1e-4)
    assert stats.exit_layers == [cut] * len(dense)
