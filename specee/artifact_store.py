"""What an engine loads for its strategies: n-gram tables, draft models, trained drafters (EAGLE
heads, Kangaroo adapters) and exit predictors, each loaded once and shared read-only by every
request. Builders receive the store; a file the user names wins over the one bundled with specee."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from .drafters.eagle import BUNDLED as BUNDLED_EAGLE
from .drafters.eagle import EagleArtifact, EagleModel
from .drafters.kangaroo import BUNDLED as BUNDLED_KANGAROO
from .drafters.kangaroo import KangarooArtifact, KangarooModel
from .drafters.ngram import NgramModel
from .exits.predictors import BUNDLED as BUNDLED_EXITS
from .exits.predictors import ExitArtifact, ExitPredictors
from .loader import dtype_name, load_parts
from .model.llama import Transformer
from .tokenizer import Tokenizer

BUNDLED_NGRAM = Path(__file__).resolve().parent / "artifacts" / "smollm2-135m-instruct.trigram.pt"


class ArtifactStore:
    def __init__(self, model: Transformer, tokenizer: Tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self._loaded: dict[tuple[str, str], object] = {}

    def ngram(self, path: str | None) -> NgramModel:
        path = given_or_bundled(path, BUNDLED_NGRAM, "the ngram method needs --ngram-model FILE (train one with "
                                                      "`specee train ngram`)")
        return self._once("ngram", path, lambda p: NgramModel.load(p, self.tokenizer.fingerprint))

    def draft_model(self, spec: str | None) -> tuple[Transformer, int | None]:
        """(draft weights, layers to use: None for all) for a path or "self:L"."""
        if spec is None:
            raise ValueError("the draft and staged methods need --draft-model PATH or --draft-model self:L")
        if spec.startswith("self:"):
            try:
                return self.model, int(spec.removeprefix("self:"))
            except ValueError:
                raise ValueError(f"--draft-model {spec!r}: write self:L with L a number of layers") from None
        return self._once("draft", spec, self._load_draft_model), None

    def _load_draft_model(self, path: str) -> Transformer:
        parts = load_parts(path, dtype=dtype_name(self.model.dtype), device=self.model.device.type)
        if parts.tokenizer.vocab != self.tokenizer.vocab:
            raise ValueError(f"draft model {path!r} does not share the target's tokenizer")
        return parts.model

    def eagle(self, path: str | None) -> EagleModel:
        return self._trained_drafter("eagle", path, BUNDLED_EAGLE, EagleArtifact, EagleModel)

    def kangaroo(self, path: str | None) -> KangarooModel:
        return self._trained_drafter("kangaroo", path, BUNDLED_KANGAROO, KangarooArtifact, KangarooModel)

    def _trained_drafter(self, kind: str, path: str | None, bundled: Path, artifact, loaded):
        path = given_or_bundled(path, bundled, f"the {kind} method needs --drafter FILE (train one with "
                                                f"`specee train {kind}`)")
        return self._once(kind, path, lambda p: loaded(self.model, artifact.load(p, self.model)))

    def exit_predictors(self, path: str | None) -> tuple[ExitArtifact, ExitPredictors]:
        """The artifact and its predictors on the model's device."""
        path = given_or_bundled(path, BUNDLED_EXITS, "--exit specee needs --exit-predictors FILE (train one with "
                                                      "`specee train exits`)")

        def load(p):
            artifact = ExitArtifact.load(p, self.model)
            return artifact, artifact.predictors(self.model.device)

        return self._once("exits", path, load)

    def _once(self, kind: str, path: str | Path, load: Callable):
        """What `load(path)` gives, loaded once per (kind, path)."""
        key = (kind, str(path))
        if key not in self._loaded:
            self._loaded[key] = load(path)
        return self._loaded[key]


def given_or_bundled(path: str | None, bundled: Path, missing: str) -> str | Path:
    """The file the user named, else the one shipped with specee (an error when it is absent)."""
    if path is not None:
        return path
    if not bundled.exists():
        raise ValueError(missing)
    return bundled
