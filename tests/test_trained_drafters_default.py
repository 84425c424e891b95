"""The bundled trained drafters (EAGLE head, Kangaroo adapter) on the default model (fp32): greedy
output identical to dense decoding, stopping at EOS, on prompts that copy and prompts that do
not; clear errors for bad drafter flags; training runs from the command line."""
import pytest
import torch

from helpers import arithmetic_corpus
from specee.cli import main
from test_speculative_lossless import MAX_TOKENS, PROMPTS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dense_to_eos(default_engine):
    # Two prompts that copy and two that do not (fp32 is slow; the default format runs them all).
    return {p: default_engine.generate(p, max_tokens=MAX_TOKENS, spec_method="none") for p in PROMPTS[:2] + PROMPTS[3:5]}


@pytest.mark.parametrize("method", ["eagle", "eagle-copy", "kangaroo"])
def test_greedy_trained_drafters_equal_dense_stopping_at_eos(default_engine, dense_to_eos, method):
    proposed = accepted = 0
    for prompt, dense in dense_to_eos.items():
        eagle = default_engine.generate(prompt, max_tokens=MAX_TOKENS, spec_method=method)
        assert (eagle.text, eagle.token_ids, eagle.finish_reason) == (dense.text, dense.token_ids, dense.finish_reason)
        assert eagle.completion_tokens == dense.completion_tokens
        proposed += eagle.stats.draft_tokens_proposed
        accepted += eagle.stats.draft_tokens_accepted
    assert 0 < accepted < proposed


@pytest.mark.parametrize("method,flags,message", [
    ("eagle", ["--drafter", "/no/such/head.pt"], "does not exist"),
    ("eagle", ["--tree", "auto"], "eagle drafts its own dynamic tree"),
    ("eagle", ["--copy-alone", "0.5"], "copy_alone applies to the eagle-copy method"),
    ("kangaroo", ["--tree", "auto"], "kangaroo drafts chains"),
    ("kangaroo", ["--drafter", "/no/such/adapter.pt"], "does not exist"),
    ("kangaroo", ["--draft-confidence", "1.5"], "--draft-confidence must be in [0, 1]"),
])
def test_bad_trained_drafter_flags_exit_2_with_a_message(capsys, method, flags, message):
    code = main(["generate", "hello", "--max-tokens", "4", "--spec-method", method, *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_copy_alone_out_of_range_is_refused(capsys):
    code = main(["generate", "hello", "--max-tokens", "4", "--spec-method", "eagle-copy", "--copy-alone", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "--copy-alone must be in [0, 1]" in err and "Traceback" not in err


def test_drafter_flag_with_another_method_is_refused(capsys):
    code = main(["generate", "hello", "--spec-method", "ngram", "--drafter", "x.pt"])
    assert code == 2 and "applies to the eagle, eagle-copy and kangaroo methods, not ngram" in capsys.readouterr().err


def test_train_eagle_from_the_command_line(tmp_path, default_engine, training_cache):
    """A short run on a small text file: an artifact that loads and drafts, and records how it was made."""
    corpus = arithmetic_corpus(tmp_path / "corpus.txt", 80)
    out = tmp_path / "head.pt"
    assert main(["train", "eagle", "--out", str(out), "--corpus", str(corpus), "--no-sharegpt", "--minutes", "0.08",
                 "--epochs", "2", "--budget", "5"]) == 0
    from specee.drafters.eagle import EagleArtifact

    artifact = EagleArtifact.load(out, default_engine.model)
    assert artifact.settings.budget == 5 and artifact.info["files"] == [str(corpus)] and artifact.info["steps"] > 0
    result = default_engine.generate("What is 3 plus 3?", max_tokens=8, spec_method="eagle", drafter=str(out))
    assert result.token_ids == default_engine.generate("What is 3 plus 3?", max_tokens=8, spec_method="none").token_ids
    # A second stage drafting 2 levels deep from that head keeps its vocabulary and settings.
    second = tmp_path / "head2.pt"
    assert main(["train", "eagle", "--out", str(second), "--corpus", str(corpus), "--no-sharegpt", "--minutes", "0.05",
                 "--epochs", "1", "--init", str(out), "--unroll", "2", "--lr", "3e-4"]) == 0
    staged = EagleArtifact.load(second, default_engine.model)
    assert staged.settings.budget == 5 and torch.equal(staged.vocab, artifact.vocab)
    assert staged.info["config"]["unroll"] == 2 and staged.info["first_stage"]["steps"] == artifact.info["steps"]
    assert len(staged.info["held_out_top1_agreement_by_depth"]) == 4


def test_an_eagle_head_is_not_a_kangaroo_drafter(capsys):
    from specee.bundled import artifact_path

    BUNDLED = artifact_path("smollm2-135m-instruct", "eagle")

    code = main(["generate", "hello", "--max-tokens", "4", "--spec-method", "kangaroo", "--drafter", str(BUNDLED)])
    assert code == 2 and "is not a specee Kangaroo drafter" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [(["--layers", "30"], "--layers must be in 1..29"),
                                           (["--eta", "2"], "--eta must be in [0, 1]")])
def test_bad_kangaroo_training_flags_exit_2(capsys, tmp_path, flags, message):
    code = main(["train", "kangaroo", "--out", str(tmp_path / "a.pt"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_train_kangaroo_from_the_command_line(tmp_path, default_engine, training_cache):
    """A short run on a small text file: an artifact that loads, drafts exactly, and records its settings."""
    corpus = arithmetic_corpus(tmp_path / "corpus.txt", 80)
    out = tmp_path / "adapter.pt"
    assert main(["train", "kangaroo", "--out", str(out), "--corpus", str(corpus), "--no-sharegpt", "--minutes", "0.08",
                 "--epochs", "2", "--layers", "3", "--eta", "0.4", "--gamma", "5"]) == 0
    from specee.drafters.kangaroo import KangarooArtifact, KangarooSettings

    artifact = KangarooArtifact.load(out, default_engine.model)
    assert artifact.settings == KangarooSettings(3, 0.4, 5)
    assert artifact.info["files"] == [str(corpus)] and artifact.info["steps"] > 0
    result = default_engine.generate("What is 3 plus 3?", max_tokens=12, spec_method="kangaroo", drafter=str(out))
    assert result.token_ids == default_engine.generate("What is 3 plus 3?", max_tokens=12, spec_method="none").token_ids
    assert result.stats.draft_tokens_proposed > 0
