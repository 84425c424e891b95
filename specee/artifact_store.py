"""What an engine loads once for its strategies and shares read-only with every request: n-gram
tables, draft models, trained drafters, exit predictors. The store knows none of them: each module
that defines an artifact registers its loader (`register_artifact`), and the builders the strategies
call ask for it by kind. A file the user names wins over the one bundled with specee."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .bundled import bundled
from .model.fingerprint import weights_fingerprint
from .model.llama import Transformer
from .registry import Registry
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class ArtifactLoader:
    name: str  # the artifact's kind, as `specee train` and bundled.py name it
    # (a file, the store: its .model and .tokenizer) -> what every request shares
    load: Callable[[str | Path, "ArtifactStore"], Any]
    missing: str  # what the error says when no file is named and none is bundled, e.g. which option names one
    train: str | None = None  # the command that makes one (default: `specee train NAME`)


LOADERS = Registry("artifact kind")
register_artifact = LOADERS.register


class ArtifactStore:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, suffix_cache: Any = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        # The engine's SuffixCache of earlier requests' text, which `auto` drafts from (not loaded,
        # not read-only: the engine adds to it as generations end).
        self.suffix_cache = suffix_cache
        self._loaded: dict[tuple[str, str], object] = {}
        self._weights_fingerprint: str | None = None

    def load(self, kind: str, path: str | Path | None):
        """The registered loader of `kind`'s artifact for the file the user named, else for the one
        bundled with specee for this model; loaded once per (kind, file)."""
        loader = LOADERS.find(kind)
        if path is None:
            path = self.bundled(kind)
            if path is None:
                train = loader.train or f"specee train {kind} --model MODEL"
                raise ValueError(f"{loader.missing}: specee bundles none for this model (train one with "
                                 f"`{train} --out FILE`)")
        key = (kind, str(path))
        if key not in self._loaded:
            self._loaded[key] = loader.load(path, self)
        return self._loaded[key]

    def bundled(self, kind: str) -> Path | None:
        """specee's own artifact of `kind` for this model (`bundled.py`), or None."""
        if self._weights_fingerprint is None:
            self._weights_fingerprint = weights_fingerprint(self.model)
        return bundled(kind, self._weights_fingerprint, self.tokenizer.fingerprint)
