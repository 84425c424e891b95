"""The header every trained specee file carries (n-gram tables, EAGLE heads, Kangaroo adapters,
exit predictors): its format and version, the fingerprint of what it was trained for, how it was
made (`info`: corpus, licence, training figures) and the settings it was chosen with. Written and
checked in one place, so a wrong file fails the same clear way whatever its kind."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


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
