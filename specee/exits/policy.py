"""The exit decision a strategy asks for after each layer: the trained predictors, or the
draft-token rule. A policy holds one generation's state (the scheduler's recent exits), so
strategies make a fresh one per generation."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .predictors import ExitPredictors, ExitSettings
from .scheduler import LayerScheduler


class LearnedExit:
    """Exit after layer i when its predictor's output exceeds the threshold; predictors run only
    on the scheduler's layers."""

    def __init__(self, predictors: ExitPredictors, settings: ExitSettings, threshold: float) -> None:
        self.predictors = predictors
        self.threshold = threshold
        self.scheduler = LayerScheduler(settings.layers, predictors.num_layers, settings.window, settings.radius)

    def active(self) -> list[bool]:
        return self.scheduler.active()

    def fires(self, layer: int, features: torch.Tensor, probs: torch.Tensor, drafter_probs: torch.Tensor) -> torch.Tensor:
        return self.predictors.layer(layer, features) > self.threshold

    def exited(self, layer: int) -> None:
        self.scheduler.record(layer)


@dataclass
class RuleSettings:
    """The draft-token exit rule (no training): over the K candidates' softmax at a layer, exit
    when the top candidate reaches p1, or the draft token (the drafter's first candidate) reaches
    p2 < p1; `draft_weight` mixes the drafter's own probability of that token into the latter.
    Checked from layer `first_layer` up (default: two thirds of the depth)."""

    p1: float = 0.8
    p2: float = 0.5
    draft_weight: float = 0.0
    first_layer: int | None = None

    def check(self) -> None:
        for name in ("p1", "p2", "draft_weight"):
            value = getattr(self, name)
            if not 0 <= value <= 1.5:
                raise ValueError(f"exit rule {name} must be in [0, 1] (above 1: never exit), got {value}")
        if self.p2 > self.p1:
            raise ValueError(f"exit rule p2 ({self.p2}) must not exceed p1 ({self.p1}): the draft token lowers the bar")


class RuleExit:
    def __init__(self, settings: RuleSettings, num_layers: int) -> None:
        first = settings.first_layer if settings.first_layer is not None else (2 * (num_layers + 1)) // 3
        self.settings = settings
        self._active = [i >= first for i in range(num_layers)]

    def active(self) -> list[bool]:
        return self._active

    def fires(self, layer: int, features: torch.Tensor, probs: torch.Tensor, drafter_probs: torch.Tensor) -> torch.Tensor:
        s = self.settings
        draft = probs[:, 0]
        if s.draft_weight:
            draft = (1 - s.draft_weight) * draft + s.draft_weight * drafter_probs.to(draft)
        return (probs.max(-1).values >= s.p1) | (draft >= s.p2)

    def exited(self, layer: int) -> None:
        pass
