import random

import pytest
import torch

from specee.drafters.ngram import NgramModel, NgramProposer

VOCAB = 12


def corpus(seed: int = 0) -> list[list[int]]:
    """Sequences with a repeated motif (so some contexts are seen often) over a 12-token vocab
    of which tokens 10 and 11 never occur, so unseen tokens must still get probability."""
    rng = random.Random(seed)
    sequences = []
    for _ in range(40):
        sequence = []
        while len(sequence) < 30:
            sequence += [1, 2, 3] if rng.random() < 0.4 else [rng.randrange(10)]
        sequences.append(sequence)
    return sequences


@pytest.fixture(scope="module")
def model() -> NgramModel:
    return NgramModel.train(corpus(), vocab_size=VOCAB, order=3, progress=False)


CONTEXTS = {
    "seen trigram context": [1, 2],
    "seen bigram context only": [11, 2],  # (11, 2) never occurred, (2,) did
    "unseen context": [10, 11],
    "single token": [3],
    "empty": [],
    "long context": [5, 6, 7, 1, 2],
}


@pytest.mark.parametrize("context", CONTEXTS.values(), ids=CONTEXTS.keys())
def test_distribution_sums_to_one_and_matches_prob_and_top_k(model, context):
    dist = model.distribution(context)
    assert dist.shape == (VOCAB,)
    assert abs(dist.sum().item() - 1.0) < 1e-6
    assert (dist > 0).all(), "every token id, seen or not, keeps some probability"
    for token in range(VOCAB):
        assert model.prob(context, token) == pytest.approx(dist[token].item(), abs=1e-12)
    for k in (1, 3, VOCAB):
        top = model.top_k(context, k)
        assert [p for _, p in top] == pytest.approx(dist.topk(k).values.tolist(), abs=1e-12)
        assert all(model.prob(context, token) == pytest.approx(p, abs=1e-12) for token, p in top)


def test_context_followed_by_every_token_still_sums_to_one():
    sequences = [[0, t] for t in range(4)] + [[1, 2, 3]]
    model = NgramModel.train(sequences, vocab_size=4, order=2, progress=False)
    assert abs(model.distribution([0]).sum().item() - 1.0) < 1e-12


def test_hand_computed_backoff():
    """Unigram counts 0:2 1:2 2:1 of N=5 (n1=1, n2=2 -> D1=0.2); bigram counts (0,1):2 (1,0):1
    (1,2):1 (n1=2, n2=1 -> D2=0.5). P1(w) = (c - 0.2)/5 + 0.2*3/(5*4): .39 .39 .19 .03.
    After 1: seen 0 and 2 get (1 - .5)/2 = .25; alpha = (.5*2/2) / (1 - .39 - .19)."""
    model = NgramModel.train([[0, 1, 0, 1, 2]], vocab_size=4, order=2, progress=False)
    assert model.distribution([]).tolist() == pytest.approx([0.39, 0.39, 0.19, 0.03])
    alpha = 0.5 / 0.42
    expected = [0.25, alpha * 0.39, 0.25, alpha * 0.03]
    assert model.distribution([1]).tolist() == pytest.approx(expected)
    # Backoff can rank an unseen continuation first: 1 was never seen after 1.
    assert model.top_k([1], 1) == [(1, pytest.approx(alpha * 0.39))]


def test_save_load_round_trip(model, tmp_path):
    """A loaded table gives the saved one's answers, and arrives prepared for `best` (a server's
    first request would otherwise build its dicts)."""
    path = tmp_path / "table.pt"
    model.save(path, fingerprint="smollm2-135m:abc")
    loaded = NgramModel.load(path, fingerprint="smollm2-135m:abc")
    assert loaded.prepared and not model.prepared
    for context in CONTEXTS.values():
        assert torch.equal(loaded.distribution(context), model.distribution(context))
        assert loaded.top_k(context, 4) == model.top_k(context, 4)
        assert loaded.best(context) == model.best(context)
    assert model.prepared  # `best` prepares a table that was not


def test_load_rejects_other_fingerprint_and_version(model, tmp_path):
    path = tmp_path / "table.pt"
    model.save(path, fingerprint="model-a")
    with pytest.raises(ValueError, match="model-a"):
        NgramModel.load(path, fingerprint="model-b")
    saved = torch.load(path, weights_only=True)
    saved["version"] = 999
    torch.save(saved, path)
    with pytest.raises(ValueError, match="version 999"):
        NgramModel.load(path, fingerprint="model-a")


def test_load_reads_a_table_written_before_the_common_header(model, tmp_path):
    """The bundled table predates the header's info and settings: it loads, its info empty."""
    path = tmp_path / "table.pt"
    model.save(path, fingerprint="model-a", info={"corpus": ["notes.txt"]})
    saved = torch.load(path, weights_only=True)
    assert saved["info"] == {"corpus": ["notes.txt"]}
    del saved["info"], saved["settings"]
    torch.save(saved, path)
    assert NgramModel.load(path, fingerprint="model-a").top_k([7, 1], 4) == model.top_k([7, 1], 4)
    with pytest.raises(ValueError, match="does not exist"):
        NgramModel.load(tmp_path / "missing.pt", fingerprint="model-a")
    torch.save({"format": "specee-eagle"}, path)
    with pytest.raises(ValueError, match="is not a specee n-gram table"):
        NgramModel.load(path, fingerprint="model-a")


def test_train_rejects_out_of_range_tokens():
    with pytest.raises(ValueError, match="token ids"):
        NgramModel.train([[0, 5]], vocab_size=4, progress=False)


def test_proposer_chain_follows_argmax(model):
    draft = NgramProposer(model, num_draft_tokens=4).propose([7, 1], max_tokens=10)
    context = [7, 1]
    for token in draft.tokens:
        assert token == model.top_k(context, 1)[0][0]
        context.append(token)
    assert draft.parents == [-1, 0, 1, 2]


def test_proposer_chain_stops_after_an_unconfident_token(model):
    """The chain ends with the first token whose table probability is below the threshold."""
    context = [3, 5]
    probs = []
    for _ in range(6):
        token, prob = model.top_k(context, 1)[0]
        probs.append(prob)
        context.append(token)
    threshold = sorted(probs)[len(probs) // 2]  # some positions above, some below
    first_below = next(i for i, p in enumerate(probs) if p < threshold)
    draft = NgramProposer(model, num_draft_tokens=6, confidence_threshold=threshold).propose([3, 5], max_tokens=6)
    assert draft.tokens == context[2 : 2 + first_below + 1]


@pytest.mark.parametrize("order", [2, 3, 4])
def test_best_from_the_seen_contexts_dicts_is_the_tables_own(order, monkeypatch):
    """`best` answers most contexts from per-order dicts of the seen contexts' best continuations
    (`seen_best`): every context of up to order - 1 tokens gets what the table itself gives, with
    the dicts and without them (a table over SEEN_BEST_LIMIT), including the seen contexts whose
    shorter contexts might win, which the dicts leave to the table."""
    import itertools

    from specee.drafters import ngram

    sequences = corpus(1) + [[4, 5, 6, 4, 5, 7]] * 3 + [[8, 9]] * 40  # 9 after 8 dominates the bigram
    with_dicts = NgramModel.train(sequences, vocab_size=VOCAB, order=order, progress=False)
    with_dicts.best([])  # builds its dicts
    answers = [answer for by_context in with_dicts.seen_best() for answer in by_context.values()]
    assert None in answers and any(answer is not None for answer in answers)
    monkeypatch.setattr(ngram, "SEEN_BEST_LIMIT", -1)
    without = NgramModel.train(sequences, vocab_size=VOCAB, order=order, progress=False)
    contexts = [list(c) for n in range(order) for c in itertools.product(range(VOCAB), repeat=n)]
    for context in contexts:
        token, prob = with_dicts.best(context)
        assert (token, prob) == without.best(context)
        assert prob == pytest.approx(without.top_k(context, 1)[0][1], abs=1e-15)
    assert with_dicts._seen_best and without._seen_best == []
