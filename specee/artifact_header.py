"""The header every trained specee file carries (n-gram tables, EAGLE heads, Kangaroo adapters,
exit predictors): its format and version, the fingerprint of what it was trained for, how it was
made (`info`: corpus, licence, training figures) and the settings it was chosen with. Written and
checked in one place, so a wrong file fails the same clear way whatever its kind. `TrainedArtifact`
is the file of trained weights for one model (EAGLE heads, Kangaroo adapters, exit predictors)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from .model.fingerprint import weights_fingerprint
from .model.llama import Transformer


@dataclass(frozen=True)
class ArtifactKind:
    format: str  # the file's "format" field, e.g. "specee-eagle"
    version: int  # the format version this specee reads and writes
    name: str  # how errors name it, e.g. "EAGLE drafter"
    train: str  # the command that makes one
    fingerprint_of: str = "model"  # what the fingerprint identifies: the model's weights, or its tokenizer

    def save(self, path: str | Path, fingerprint: str, body: dict, info: dict | None = None,
             settings: dict | None = None) -> None:
        """One file: the header, then `body` (what the kind itself stores)."""
        torch.save({"format": self.format, "version": self.version, "fingerprint": fingerprint,
                    "info": info or {}, "settings": settings or {}, **body}, path)

    def load(self, path: str | Path, fingerprint: str) -> dict:
        """What a file of this kind trained for `fingerprint` holds (`info` and `settings` empty
        where a file has none); any other file is a ValueError that says what to do."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"{self.name} {str(path)!r} does not exist")
        try:
            saved = torch.load(path, weights_only=True)
        except Exception as e:
            raise ValueError(f"{path} is not a specee {self.name} ({type(e).__name__})") from None
        if not isinstance(saved, dict) or saved.get("format") != self.format:
            raise ValueError(f"{path} is not a specee {self.name}")
        retrain = f"train one with `{self.train} --out FILE`"
        if saved["version"] != self.version:
            raise ValueError(f"{path} has {self.name} format version {saved['version']}, this specee reads "
                             f"{self.version}: {retrain}")
        if saved["fingerprint"] != fingerprint:
            raise ValueError(f"{path} was trained for another {self.fingerprint_of} (fingerprint "
                             f"{saved['fingerprint']!r}, this model's is {fingerprint!r}): {retrain}")
        return {"info": {}, "settings": {}} | saved


@dataclass
class TrainedArtifact:
    """Trained weights for one model: the weights, the reduced vocabulary, the settings they were
    chosen with (by measurement) and how they were made. Subclasses name the format and the settings."""

    HEADER: ClassVar[ArtifactKind]
    SETTINGS: ClassVar[type]

    weights: dict
    vocab: torch.Tensor  # [N] token ids the drafter scores, most frequent first
    fingerprint: str
    settings: Any = None
    info: dict = field(default_factory=dict)  # corpus, licence, training figures

    def __post_init__(self) -> None:
        if self.settings is None:
            self.settings = self.SETTINGS()

    def save(self, path: str | Path) -> None:
        # "head": the drafter's own trained weights (the key predates the adapter)
        self.HEADER.save(path, self.fingerprint, {
            "head": {k: v.detach().to("cpu", torch.float16) for k, v in self.weights.items()},
            "vocab": self.vocab.to(torch.int32)}, self.info, vars(self.settings))

    @classmethod
    def load(cls, path: str | Path, model: Transformer):
        """The weights trained for `model`; a file for another model (or of another kind) is a ValueError."""
        saved = cls.HEADER.load(path, weights_fingerprint(model))
        return cls(saved["head"], saved["vocab"].long(), saved["fingerprint"], cls.SETTINGS(**saved["settings"]),
                   saved["info"])
