"""Early exit on the default model (fp32): the bundled predictors and the rule, thresholds that
never fire reproduce dense decoding, stats in --json, clear errors for bad flags, and training
from the command line."""
import json

import pytest
import torch

from helpers import arithmetic_corpus, tiny_model
from specee.cli import main
from specee.bundled import artifact_path
from specee.exits.predictors import ExitArtifact
from specee.exits.registry import EXIT_KINDS, ExitKind, register_exit

pytestmark = pytest.mark.slow

FAITHFUL_PREFIX = 16  # exits are lossy: the start of the answer must still be dense's (all 32 were)
PROMPTS = ["Summarize: The cat sat on the mat. The cat sat on the mat because the mat was warm.",
           "Write a Python function that returns the square of a number."]


@pytest.fixture(scope="module")
def dense_answers(default_engine):
    return [default_engine.generate(prompt, max_tokens=40, spec_method="none") for prompt in PROMPTS]


@pytest.mark.parametrize("options", [dict(exit="specee", exit_threshold=1.5),
                                     dict(exit="specee", exit_threshold=1.5, spec_method="hybrid"),
                                     dict(exit="specee", exit_threshold=1.5, spec_method="hybrid", tree="auto"),
                                     dict(exit="specee", exit_threshold=1.5, spec_method="eagle-copy"),
                                     dict(exit="specee", exit_threshold=1.5, spec_method="kangaroo", exit_kv="approx"),
                                     dict(exit="specee", exit_threshold=1.5, exit_kv="approx"),
                                     dict(exit="rule", exit_rule="1.01,1.01")])
def test_exits_that_never_fire_equal_dense(default_engine, dense_answers, options):
    """Token-identical to dense, every pass full depth; inside verification, the same drafts
    proposed and accepted as the speculative mode without exits."""
    accepted = 0
    for prompt, dense in zip(PROMPTS, dense_answers):
        result = default_engine.generate(prompt, max_tokens=40, **options)
        assert (result.text, result.token_ids, result.finish_reason) == (dense.text, dense.token_ids, dense.finish_reason)
        assert result.stats.predictors_run > 0 and set(result.stats.exit_layers) == {30}
        if "spec_method" in options:
            plain = default_engine.generate(prompt, max_tokens=40, spec_method=options["spec_method"],
                                            **({"tree": options["tree"]} if "tree" in options else {}))
            assert (result.stats.draft_tokens_proposed, result.stats.draft_tokens_accepted) == \
                (plain.stats.draft_tokens_proposed, plain.stats.draft_tokens_accepted)
            accepted += result.stats.draft_tokens_accepted
    assert "spec_method" not in options or accepted > 0


def test_bundled_predictors_exit_early_on_the_default_model_and_refuse_other_weights(default_engine):
    """What the bundled file promises: on the default model its predictors end passes early while
    the answer starts as dense's; trained for these weights, it refuses others with a clear message."""
    dense = default_engine.generate(PROMPTS[0], max_tokens=32, ignore_eos=True, spec_method="none")
    early = default_engine.generate(PROMPTS[0], max_tokens=32, ignore_eos=True, exit="specee")
    assert min(early.stats.exit_layers) < 30
    assert early.token_ids[:FAITHFUL_PREFIX] == dense.token_ids[:FAITHFUL_PREFIX]
    other = tiny_model(seed=1, vocab_size=default_engine.config.vocab_size, num_hidden_layers=2)
    with pytest.raises(ValueError, match="trained for another model"):
        ExitArtifact.load(artifact_path("smollm2-135m-instruct", "exits"), other)


class FromLayer:
    """A toy exit policy: exit at a fixed layer whatever the features say, confirmed by the full head
    only when the draft token is the head's top token (so the output stays dense's)."""

    def __init__(self, layer: int, num_layers: int) -> None:
        self._active = [i == layer for i in range(num_layers)]

    def active(self) -> list[bool]:
        return self._active

    def fires(self, layer, features, probs, drafter_probs):
        return torch.ones(probs.shape[0], dtype=torch.bool)

    def confirms(self, logits, first, drafter_probs):
        return logits.argmax(-1) == first

    def exited(self, layer: int) -> None:
        pass


def test_a_registered_exit_kind_runs_from_the_engine_and_the_command_line(default_engine, capsys):
    """A new exit policy is its class and one register_exit call: the engine, the option checks and
    the CLI take it by name."""
    kind = register_exit(ExitKind("from-layer", lambda config, artifacts, layers: (lambda: FromLayer(27, layers), 4)))
    try:
        dense = default_engine.generate(PROMPTS[0], max_tokens=24, spec_method="none")
        result = default_engine.generate(PROMPTS[0], max_tokens=24, exit="from-layer")
        assert result.token_ids == dense.token_ids
        assert set(result.stats.exit_layers) <= {28, 30} and 28 in result.stats.exit_layers  # layer 27 ran: 28 layers
        assert main(["generate", PROMPTS[0], "--max-tokens", "4", "--exit", "from-layer", "--exit-rule", "0.9,0.5"]) == 2
        assert "--exit-rule: --exit from-layer does not read them" in capsys.readouterr().err
    finally:
        del EXIT_KINDS[kind.name]
    with pytest.raises(ValueError, match="unknown exit 'from-layer'"):
        default_engine.generate(PROMPTS[0], max_tokens=4, exit="from-layer")


@pytest.mark.parametrize("exit_flags", [["--exit", "specee"], ["--exit", "rule", "--exit-kv", "approx"]])
def test_exit_stats_in_json(capsys, exit_flags):
    assert main(["generate", PROMPTS[0], "--max-tokens", "24", "--ignore-eos", "--json", *exit_flags]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]
    passes = stats["generated_tokens"] - 1
    assert sum(stats["exit_histogram"].values()) == len(stats["exit_layers"]) == passes
    assert stats["avg_forward_layers"] == pytest.approx(sum(stats["exit_layers"]) / passes)
    assert stats["predictors_per_token"] > 0 and 0 <= stats["predictor_share"] < 1


@pytest.mark.parametrize("flags,message", [
    (["--exit", "warp"], "unknown --exit 'warp'"),
    (["--exit-threshold", "0.5"], "--exit-threshold need --exit specee or --exit rule"),
    (["--exit", "specee", "--spec-method", "hybrid", "--temperature", "0.7"], "runs greedy only"),
    (["--exit", "rule", "--exit-rule", "0.3,0.8"], "must not exceed p1"),
    (["--exit", "rule", "--exit-rule", "fast"], "write P1,P2[,W[,L]]"),
    (["--exit", "rule", "--exit-rule", "0.9,0.5,0,2.5"], "write P1,P2[,W[,L]]"),
    (["--exit", "rule", "--exit-rule", "0.9,0.5,0,29"], "first layer must be in 0..28"),
    (["--exit", "rule", "--exit-threshold", "0.5"], "--exit-threshold: --exit rule does not read them"),
    (["--exit", "specee", "--exit-rule", "0.9,0.5"], "--exit-rule: --exit specee does not read them"),
    (["--exit", "specee", "--exit-predictors", "/no/such/file.pt"], "does not exist"),
    (["--exit", "specee", "--exit-predictors", "KANGAROO"], "is not a specee exit predictor file"),
])
def test_bad_exit_flags_exit_2_with_a_message(capsys, flags, message):
    KANGAROO = artifact_path("smollm2-135m-instruct", "kangaroo")

    flags = [str(KANGAROO) if f == "KANGAROO" else f for f in flags]
    code = main(["generate", "hello", "--max-tokens", "4", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_train_exits_from_the_command_line(tmp_path, default_engine, training_cache):
    """A short run on a small text file: an artifact that loads, decodes, and records how it was made."""
    corpus = arithmetic_corpus(tmp_path / "corpus.txt", 40)
    out = tmp_path / "exits.pt"
    assert main(["train", "exits", "--out", str(out), "--corpus", str(corpus), "--no-sharegpt", "--tokens", "300",
                 "--minutes", "0.2", "--epochs", "3"]) == 0
    artifact = ExitArtifact.load(out, default_engine.model)
    assert artifact.info["files"] == [str(corpus)] and artifact.info["steps"] > 0 and artifact.info["tokens"] >= 300
    assert len(artifact.info["positive_share_per_layer"]) == 29
    assert 0.5 <= artifact.settings.threshold < 1
    dense = default_engine.generate("What is 3 plus 3?", max_tokens=12, spec_method="none")
    never = default_engine.generate("What is 3 plus 3?", max_tokens=12, exit="specee", exit_predictors=str(out),
                                    exit_threshold=1.5)
    assert never.token_ids == dense.token_ids


@pytest.mark.parametrize("flags,message", [(["--fidelity", "2"], "--fidelity must be in (0, 1]"),
                                           (["--no-sharegpt"], "--no-sharegpt needs --corpus")])
def test_bad_exit_training_flags_exit_2(capsys, tmp_path, flags, message):
    code = main(["train", "exits", "--out", str(tmp_path / "a.pt"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
