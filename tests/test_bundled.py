"""Bundled artifacts are found by the fingerprints of the model they were trained for (`bundled.py`)."""
import json

import pytest
import torch

from specee import bundled as bundled_module
from specee.bundled import KINDS, artifact_path, bundled, models


def test_every_bundled_file_is_indexed_under_the_fingerprint_its_header_names():
    files = sorted(bundled_module.ARTIFACTS.glob("*.pt"))
    assert files, "specee bundles artifacts"
    for path in files:
        name, suffix, _ = path.name.rsplit(".", 2)
        kind = next(kind for kind, (s, _) in KINDS.items() if s == suffix)
        header = torch.load(path, weights_only=True)
        assert models()[name][KINDS[kind][1]] == header["fingerprint"], path.name
        assert bundled(kind, models()[name]["weights"], models()[name]["tokenizer"]) == path


def test_a_model_is_matched_by_its_own_fingerprints_only(tmp_path, monkeypatch):
    (tmp_path / "models.json").write_text(json.dumps({"a": {"weights": "w-a", "tokenizer": "t-shared"},
                                                      "b": {"weights": "w-b", "tokenizer": "t-shared"}}))
    for name, suffix in (("a", "eagle"), ("b", "exits"), ("a", "trigram")):
        (tmp_path / f"{name}.{suffix}.pt").write_bytes(b"")
    monkeypatch.setattr(bundled_module, "ARTIFACTS", tmp_path)
    monkeypatch.setattr(bundled_module, "INDEX", tmp_path / "models.json")
    bundled_module.models.cache_clear()
    try:
        assert bundled("eagle", "w-a", "t-x") == artifact_path("a", "eagle")
        assert bundled("eagle", "w-b", "t-shared") is None  # b has no EAGLE head; a's is not b's
        assert bundled("exits", "w-b", "t-x") == artifact_path("b", "exits")
        # A table depends on the vocabulary only: a model sharing a's tokenizer takes a's table.
        assert bundled("ngram", "w-b", "t-shared") == artifact_path("a", "ngram")
        assert bundled("ngram", "w-a", "t-other") is None
    finally:
        bundled_module.models.cache_clear()


@pytest.mark.parametrize("method", ["eagle", "kangaroo"])
def test_a_model_without_bundled_drafters_is_told_how_to_train_one(method):
    from helpers import tiny_model
    import specee.drafters  # noqa: F401  (registers the drafters' artifacts)
    from specee.artifact_store import ArtifactStore

    class Tokenizer:
        fingerprint = "no such tokenizer"

    store = ArtifactStore(tiny_model(), Tokenizer())
    with pytest.raises(ValueError, match=f"specee bundles none for this model.*specee train {method} --model"):
        store.load(method, None)
