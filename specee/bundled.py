"""The trained artifacts bundled with specee, found by the model they were trained for. Each model's
files sit side by side in `specee/artifacts/` as `<model>.<kind>.pt`, and `artifacts/models.json`
names each model's fingerprints: of its weights (EAGLE heads, Kangaroo adapters, exit predictors)
and of its tokenizer (n-gram tables, which any model with that vocabulary can use)."""
from __future__ import annotations

import functools
import json
from pathlib import Path

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
INDEX = ARTIFACTS / "models.json"
# kind (as `specee train` names it) -> (its files' suffix, which fingerprint it is tied to)
KINDS = {"ngram": ("trigram", "tokenizer"), "eagle": ("eagle", "weights"), "kangaroo": ("kangaroo", "weights"),
         "exits": ("exits", "weights")}


@functools.cache
def models() -> dict[str, dict[str, str]]:
    """model name -> {"weights": fingerprint, "tokenizer": fingerprint}."""
    return json.loads(INDEX.read_text())


def artifact_path(model: str, kind: str) -> Path:
    """Where `model`'s artifact of `kind` is bundled (whether or not it is)."""
    return ARTIFACTS / f"{model}.{KINDS[kind][0]}.pt"


def bundled(kind: str, weights: str, tokenizer: str) -> Path | None:
    """The bundled artifact of `kind` for a model with these fingerprints, or None (always for a kind
    specee ships no file of)."""
    if kind not in KINDS:
        return None
    suffix, tied_to = KINDS[kind]
    wanted = tokenizer if tied_to == "tokenizer" else weights
    for name, prints in models().items():
        if prints[tied_to] == wanted and artifact_path(name, kind).exists():
            return artifact_path(name, kind)
    return None
