"""What an engine loads for its strategies: n-gram tables, draft models, trained drafters (EAGLE
heads, Kangaroo adapters) and exit predictors, each loaded once and shared read-only by every
request. Builders receive the store; a file the user names wins over the one bundled with specee."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from .bundled import bundled
from .drafters.eagle import EagleArtifact, EagleModel
from .drafters.kangaroo import KangarooArtifact, KangarooModel
from .drafters.ngram import NgramModel
from .drafters.suffix_cache import SuffixCache
from .exits.predictors import ExitArtifact, ExitPredictors
from .loader import dtype_name, load_parts
from .model.fingerprint import weights_fingerprint
from .model.llama import Transformer
from .tokenizer import Tokenizer


class ArtifactStore:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, suffix_cache: SuffixCache | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        # The engine's text of earlier requests, which `auto` drafts from (not loaded, not read-only:
        # the engine adds to it as generations end).
        self.suffix_cache = suffix_cache
        self._loaded: dict[tuple[str, str], object] = {}
        self._weights_fingerprint: str | None = None

    def ngram(self, path: str | None) -> NgramModel:
        return self._load("ngram", path, lambda p: NgramModel.load(p, self.tokenizer.fingerprint),
                          "the ngram method needs --ngram-model FILE")

    def draft_model(self, spec: str | None) -> tuple[Transformer, int | None]:
        """(draft weights, layers to use: None for all) for a path or "self:L"."""
        if spec is None:
            raise ValueError("the draft and staged methods need --draft-model PATH or --draft-model self:L")
        if spec.startswith("self:"):
            try:
                return self.model, int(spec.removeprefix("self:"))
            except ValueError:
                raise ValueError(f"--draft-model {spec!r}: write self:L with L a number of layers") from None
        return self._load("draft", spec, self._load_draft_model), None

    def _load_draft_model(self, path: str) -> Transformer:
        parts = load_parts(path, dtype=dtype_name(self.model.dtype), device=self.model.device.type)
        if parts.tokenizer.vocab != self.tokenizer.vocab:
            raise ValueError(f"draft model {path!r} does not share the target's tokenizer")
        return parts.model

    def eagle(self, path: str | None) -> EagleModel:
        return self._load("eagle", path, lambda p: EagleModel(self.model, EagleArtifact.load(p, self.model)),
                          "the eagle method needs --drafter FILE")

    def kangaroo(self, path: str | None) -> KangarooModel:
        return self._load("kangaroo", path, lambda p: KangarooModel(self.model, KangarooArtifact.load(p, self.model)),
                          "the kangaroo method needs --drafter FILE")

    def exit_predictors(self, path: str | None) -> tuple[ExitArtifact, ExitPredictors]:
        """The artifact and its predictors on the model's device."""
        def load(p):
            artifact = ExitArtifact.load(p, self.model)
            return artifact, artifact.predictors(self.model.device)

        return self._load("exits", path, load, "--exit specee needs --exit-predictors FILE")

    def bundled(self, kind: str) -> Path | None:
        """specee's own artifact of `kind` for this model (`bundled.py`), or None."""
        if self._weights_fingerprint is None:
            self._weights_fingerprint = weights_fingerprint(self.model)
        return bundled(kind, self._weights_fingerprint, self.tokenizer.fingerprint)

    def _load(self, kind: str, path: str | None, load: Callable, missing: str = ""):
        """What `load` gives for the file the user named, else for the one bundled with specee for this
        model (`missing` says which option names one when there is none); loaded once per (kind, file)."""
        if path is None:
            path = self.bundled(kind)
            if path is None:
                raise ValueError(f"{missing}: specee bundles none for this model (train one with "
                                 f"`specee train {kind} --model MODEL --out FILE`)")
        key = (kind, str(path))
        if key not in self._loaded:
            self._loaded[key] = load(path)
        return self._loaded[key]
