"""Speculative methods defined here, outside specee, are registered and then used by name from the
engine, the command line and a server request, with no edit anywhere else: the registry is the one
list of methods. A trained one is its drafter, its file's loader and two registration lines: the
artifact store loads it by kind, knowing no drafter."""
import json

import pytest
import torch
from fastapi.testclient import TestClient

import specee
from helpers import tiny_model_directory
from specee.artifact_header import ArtifactKind
from specee.artifact_store import LOADERS, ArtifactLoader, register_artifact
from specee.cli import build_parser, main
from specee.drafters.base import Proposer
from specee.drafters.registry import METHODS, Drafting, SpecMethod, register
from specee.server.app import ServerConfig, create_app
from specee.server.completions import Defaults
from specee.verification.draft import Draft

PROMPTS = ["the cat sat on the mat", "one two three", "red red red red"]
MAX_TOKENS = 48


class RepeatLast(Proposer):
    """Guesses that the last token repeats: mostly wrong on a random model, now and then right."""

    def propose(self, context, max_tokens):
        return Draft.chain([context[-1]] * max_tokens)


# A trained drafter: a table of which token followed which in the text it was trained on.
BIGRAMS = ArtifactKind("specee-toy-bigrams", 1, "toy bigram table", "bigrams_of", fingerprint_of="tokenizer")


class Bigrams(Proposer):
    def __init__(self, follows: dict[int, int]) -> None:
        self.follows = follows

    def propose(self, context, max_tokens):
        tokens = []
        while len(tokens) < max_tokens and (token := self.follows.get((context + tokens)[-1])) is not None:
            tokens.append(token)
        return Draft.chain(tokens)


def bigrams_of(ids: list[int], path, fingerprint: str) -> None:
    """Train: the token after each one in `ids` (the latest wins), saved as [pairs, 2]."""
    BIGRAMS.save(path, fingerprint, {"pairs": torch.tensor(list(dict(zip(ids, ids[1:])).items()))})


def load_bigrams(path, store) -> dict[int, int]:
    return dict(BIGRAMS.load(path, store.tokenizer.fingerprint)["pairs"].tolist())


@pytest.fixture(scope="module", autouse=True)
def toy_trained():
    loader = register_artifact(ArtifactLoader("toy-bigrams", load_bigrams, "toy-bigrams needs --drafter FILE",
                                              train="bigrams_of"))
    method = register(SpecMethod("toy-bigrams", lambda config, artifacts: Drafting(
        lambda: Bigrams(artifacts.load("toy-bigrams", config.drafter)), num_draft_tokens=4), options=("drafter",)))
    yield
    del METHODS[method.name], LOADERS[loader.name]


@pytest.fixture(scope="module", autouse=True)
def toy():
    method = register(SpecMethod("toy-repeat", lambda options, artifacts: Drafting(RepeatLast)))
    yield method
    del METHODS[method.name]


@pytest.fixture(scope="module")
def model_directory(tmp_path_factory):
    return tiny_model_directory(tmp_path_factory.mktemp("tiny-model"), seed=5)


@pytest.fixture(scope="module")
def engine(model_directory):
    return specee.load(model_directory, quantization="none", compile=False)


def test_the_engine_runs_a_registered_method_by_name_losslessly(engine):
    accepted = proposed = 0
    for prompt in PROMPTS:
        dense = engine.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, chat=False, spec_method="none")
        toy = engine.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, chat=False, spec_method="toy-repeat")
        assert toy.token_ids == dense.token_ids
        accepted += toy.stats.draft_tokens_accepted
        proposed += toy.stats.draft_tokens_proposed
    assert 0 < accepted < proposed  # its drafts were verified, some kept and some refused


def test_the_engine_runs_a_registered_trained_method_losslessly(engine, tmp_path):
    with pytest.raises(ValueError, match=r"toy-bigrams needs --drafter FILE: specee bundles none for this model "
                                         r"\(train one with `bigrams_of --out FILE`\)"):
        engine.strategy("toy-bigrams")
    options = dict(max_tokens=MAX_TOKENS, ignore_eos=True, chat=False)
    dense = [engine.generate(prompt, spec_method="none", **options).token_ids for prompt in PROMPTS]
    path = tmp_path / "bigrams.pt"
    bigrams_of(engine.encode(PROMPTS[0], chat=False) + dense[0], path, engine.tokenizer.fingerprint)
    for prompt, expected in zip(PROMPTS, dense):
        trained = engine.generate(prompt, spec_method="toy-bigrams", drafter=str(path), **options)
        assert trained.token_ids == expected
        assert trained.stats.draft_tokens_proposed > 0
    assert trained.stats.draft_tokens_accepted < trained.stats.draft_tokens_proposed  # the table is not the model
    first = engine.generate(PROMPTS[0], spec_method="toy-bigrams", drafter=str(path), **options)
    assert first.stats.draft_tokens_accepted > MAX_TOKENS // 2  # drafts from the text it was trained on


def test_capabilities_a_method_leaves_out_are_refused(engine):
    with pytest.raises(ValueError, match=r"needs a drafter with probabilities \(ngram, hybrid, draft, kangaroo\)"):
        engine.strategy("toy-repeat", confidence_threshold=0.5)  # not registered as scored
    with pytest.raises(ValueError, match="drafts chains only"):
        engine.strategy("toy-repeat", tree="auto")  # its proposer has no candidates
    with pytest.raises(ValueError, match="copy_alone applies to the eagle-copy method, not toy-repeat"):
        engine.strategy("toy-repeat", copy_alone=0.5)


def test_the_command_line_takes_a_registered_method(model_directory, capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "toy-repeat" in capsys.readouterr().out
    assert build_parser().parse_args(["generate", "hi", "--spec-method", "toy-repeat"]).spec_method == "toy-repeat"
    assert main(["generate", "hi", "--spec-method", "toy-unregistered"]) == 2
    assert "unknown --spec-method 'toy-unregistered' (choose from none, " in capsys.readouterr().err
    answers = []
    for method in ("none", "toy-repeat"):
        code = main(["generate", PROMPTS[0], "--model", str(model_directory), "--quantization", "none",
                     "--no-compile", "--no-chat", "--ignore-eos", "--max-tokens", str(MAX_TOKENS), "--json",
                     "--spec-method", method])
        assert code == 0
        answers.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    dense, toy = answers
    assert toy["token_ids"] == dense["token_ids"] and len(toy["token_ids"]) == MAX_TOKENS
    assert toy["stats"]["draft_tokens_proposed"] > 0 == dense["stats"]["draft_tokens_proposed"]


def test_a_server_request_takes_a_registered_method(engine):
    config = ServerConfig("tiny", Defaults({"max_tokens": MAX_TOKENS, "ignore_eos": True}))
    with TestClient(create_app(engine, config)) as client:
        def complete(specee_options=None):
            body = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS}
            return client.post("/v1/completions", json=body | ({"specee": specee_options} if specee_options else {}))

        dense, toy = complete(), complete({"spec_method": "toy-repeat"})
        unknown = complete({"spec_method": "toy-unregistered"})
    assert dense.status_code == toy.status_code == 200
    assert toy.json()["choices"][0]["text"] == dense.json()["choices"][0]["text"]
    assert toy.json()["specee"]["stats"]["draft_tokens_proposed"] > 0
    assert toy.json()["usage"] == dense.json()["usage"]
    assert unknown.status_code == 400
    assert "unknown speculative method 'toy-unregistered'" in unknown.json()["error"]["message"]
    assert "toy-repeat" in unknown.json()["error"]["message"]
