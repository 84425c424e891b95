"""`specee train ngram`: a table trained from a corpus drives the ngram drafter; one trained on the
model's own answers reads them after the prompt's last tokens; its calibration, measured on held-out
text, is saved with it and is `auto`'s prior for it; ShareGPT's first turns leave out benchmarks and
pasted documents; a table made for another model is refused with a clear message."""
import json

import pytest

from helpers import tiny_model
from specee.cli import main
from specee.drafters.ngram import NgramModel
from specee.engine import Engine
from specee.drafters.auto import PRIORS
from specee.train import corpus as corpus_module
from specee.train.ngram import HOLD_OUT, held_out_calibration, self_generated, train_ngram


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


def test_calibration_is_measured_on_held_out_text_saved_and_autos_prior(engine, tmp_path):
    sentence = [5, 9, 2, 7, 3, 8, 1, 4]
    # Held-out text that continues as the training text: the table's guesses are right more often
    # than it says (absolute discounting keeps mass for the unseen); held-out text that runs the
    # other way: its confident guesses are wrong.
    assert held_out_calibration([sentence * 3] * 40, vocab_size=16, order=3) > 1.0
    reversed_held_out = [sentence[::-1] * 3 if i % HOLD_OUT == 0 else sentence * 3 for i in range(40)]
    assert held_out_calibration(reversed_held_out, vocab_size=16, order=3) < 0.2
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(["the cat sat on the mat and looked at the dog"] * 30))
    out = tmp_path / "table.pt"
    made = train_ngram(engine, out, corpus=[str(corpus)])
    table = NgramModel.load(out, engine.tokenizer.fingerprint)
    assert table.calibration == made.calibration > 1.0
    drafter = engine.strategy("auto", ngram_model=str(out)).make_proposer()
    drafter.reset(engine.encode("the cat"))
    assert drafter.calibrations["ngram"].prior == table.calibration != PRIORS["ngram"]
    table.calibration = None  # a table trained before calibrations were measured: half its word
    drafter = engine.strategy("auto").make_proposer()
    drafter.table = table
    drafter.reset(engine.encode("the cat"))
    assert drafter.calibrations["ngram"].prior == PRIORS["ngram"]


def test_self_generated_answers_follow_the_prompts_last_tokens_and_are_the_models_own(engine):
    prompts = ["the cat sat on the", "Count from one to ten.", "Hello there", "the dog", "a b c"]
    answers = self_generated(engine, prompts, max_tokens=12, context=2)
    for prompt, answer in zip(prompts, answers, strict=True):
        ids = engine.encode(prompt)
        alone = engine.generate(prompt, max_tokens=12, spec_method="none")
        assert answer == ids[-2:] + alone.token_ids


def test_sharegpt_first_turns_leave_out_benchmarks_and_pasted_documents(monkeypatch, tmp_path):
    benchmark = "What is the capital of France? Answer in one word."
    conversations = [["Tell me a joke about cats.", "Why..."], [benchmark, "Paris"],
                     ["x" * (corpus_module.FIRST_TURN_CHARS + 1), "ok"], ["Explain recursion simply.", "It..."],
                     ["Name three rivers.", "Nile..."]]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
                                for q, a in conversations]))
    monkeypatch.setattr(corpus_module, "sharegpt_path", lambda: path)
    monkeypatch.setattr(corpus_module, "benchmark_keys", lambda: {corpus_module.prompt_key(benchmark)})
    assert corpus_module.sharegpt_first_turns(2) == ["Tell me a joke about cats.", "Explain recursion simply."]
    assert corpus_module.sharegpt_first_turns(9)[-1] == "Name three rivers."
