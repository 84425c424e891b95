"""`specee train ngram`: a table trained from a corpus drives the ngram drafter, and a table made
for another model is refused with a clear message."""
import pytest

from helpers import tiny_model
from specee.cli import main
from specee.drafters.ngram import NgramModel
from specee.engine import Engine
from specee.train.ngram import train_ngram


@pytest.fixture
def engine(tiny_tokenizer):
    return Engine(tiny_model(vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=1), tiny_tokenizer)


def test_trained_table_drafts_the_corpus_continuation(engine, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(["the cat sat on the mat and looked at the dog"] * 30))
    out = tmp_path / "table.pt"
    train_ngram(engine, out, corpus=[str(corpus)])
    table = NgramModel.load(out, engine.tokenizer.fingerprint)
    ids = engine.tokenizer.encode("the cat sat on the", add_special_tokens=False)
    expected_next = engine.tokenizer.encode(" mat", add_special_tokens=False)[0]
    assert table.top_k(ids, 1)[0][0] == expected_next
    strategy = engine.strategy("ngram", ngram_model=str(out))
    draft = strategy.draft(strategy.make_proposer(), ids, 3)
    assert engine.tokenizer.decode(draft.tokens) == " mat and looked"


@pytest.mark.slow  # the CLI loads the default model
def test_table_for_another_model_is_refused(capsys, tmp_path):
    path = tmp_path / "other.pt"
    NgramModel.train([[1, 2, 3, 1, 2, 4]], vocab_size=49152, progress=False).save(path, "another-model")
    code = main(["generate", "hello", "--spec-method", "ngram", "--ngram-model", str(path), "--max-tokens", "4"])
    assert code == 2
    assert "another-model" in capsys.readouterr().err


def test_training_without_data_is_a_clear_error(engine, tmp_path):
    with pytest.raises(ValueError, match="nothing to train on"):
        train_ngram(engine, tmp_path / "x.pt")
