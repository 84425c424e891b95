"""The exit decision a strategy asks for after each layer: the trained predictors, or the
draft-token rule. A policy holds one generation's state (the scheduler's recent exits), so
strategies make a fresh one per generation."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from .predictors import ExitPredictors, ExitSettings
from .registry import ExitKind, register_exit
from .scheduler import LayerScheduler

RULE_CANDIDATES = 4


class ExitPolicy(Protocol):
    """What a pass with exits (strategies/exit_pass.py) asks a policy, layer by layer."""

    def active(self) -> list[bool]: ...  # [layers - 1]: whose decision runs for the next pass
    # Per row: features [T, 3K], candidate softmax [T, K], the drafter's probability of each row's
    # first candidate [T] -> whether the row's policy asks to exit [T] (bool).
    def fires(self, layer: int, features: torch.Tensor, probs: torch.Tensor, drafter_probs: torch.Tensor) -> torch.Tensor: ...
    # After the full head ran on fired rows: logits [n, vocab], each row's first candidate [n] and
    # the drafter's probability of it [n] -> whether the exit stands [n] (bool).
    def confirms(self, logits: torch.Tensor, first: torch.Tensor, drafter_probs: torch.Tensor) -> torch.Tensor: ...
    def exited(self, layer: int) -> None: ...


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

    def confirms(self, logits: torch.Tensor, first: torch.Tensor, drafter_probs: torch.Tensor) -> torch.Tensor:
        return torch.ones(logits.shape[0], dtype=torch.bool)  # the predictor decided; the check only verifies

    def exited(self, layer: int) -> None:
        self.scheduler.record(layer)


@dataclass
class RuleSettings:
    """The draft-token exit rule (no training): over the full vocabulary's softmax at a layer,
    exit when the top token reaches p1, or the draft token (the drafter's first candidate)
    reaches p2 < p1; `draft_weight` mixes the drafter's own probability of that token into the
    latter. Checked from layer `first_layer` up (default: seven eighths of the depth). The
    defaults are the best exit fidelity measured on the tuning prompts (BENCHMARKS.md); the idea's
    author suggested 0.8 and 0.5, which exit far more often and far less faithfully here."""

    p1: float = 0.99
    p2: float = 0.9
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
    """The rule in two steps: the K candidates' softmax, which every token's features already
    hold, passes a row only if the full vocabulary's could (a candidate's share of K is at least
    its share of the vocabulary); then the full head, which an exit runs anyway, decides."""

    def __init__(self, settings: RuleSettings, num_layers: int) -> None:
        first = settings.first_layer
        if first is None:
            first = min(num_layers - 1, (7 * (num_layers + 1)) // 8)
        if not 0 <= first < num_layers:
            raise ValueError(f"the exit rule's first layer must be in 0..{num_layers - 1}, got {first}")
        self.settings = settings
        self._active = [i >= first for i in range(num_layers)]

    def active(self) -> list[bool]:
        return self._active

    def fires(self, layer: int, features: torch.Tensor, probs: torch.Tensor, drafter_probs: torch.Tensor) -> torch.Tensor:
        return self._passes(probs.max(-1).values, probs[:, 0], drafter_probs)

    def confirms(self, logits: torch.Tensor, first: torch.Tensor, drafter_probs: torch.Tensor) -> torch.Tensor:
        probs = logits.float().softmax(-1)
        return self._passes(probs.max(-1).values, probs.gather(-1, first[:, None])[:, 0], drafter_probs)

    def _passes(self, top: torch.Tensor, draft: torch.Tensor, drafter_probs: torch.Tensor) -> torch.Tensor:
        s = self.settings
        if s.draft_weight:
            draft = (1 - s.draft_weight) * draft + s.draft_weight * drafter_probs.to(draft)
        return (top >= s.p1) | (draft >= s.p2)

    def exited(self, layer: int) -> None:
        pass


def rule_settings(rule: str | None) -> RuleSettings:
    if rule is None:
        return RuleSettings()
    try:
        values = [float(v) for v in str(rule).split(",")]
    except ValueError:
        values = []
    if len(values) not in (2, 3, 4) or (len(values) == 4 and not values[3].is_integer()):
        raise ValueError(f"exit rule {rule!r}: write P1,P2[,W[,L]] (e.g. 0.8,0.5; L: a layer number)")
    settings = RuleSettings(*values[:3], *(int(v) for v in values[3:]))
    settings.check()
    return settings


def _learned(config, artifacts, num_layers: int):
    artifact, predictors = artifacts.load("exits", config.predictors)
    if predictors.num_layers != num_layers:
        raise ValueError(f"the exit predictors cover {predictors.num_layers} layers, the model has {num_layers + 1}")
    threshold = artifact.settings.threshold if config.threshold is None else config.threshold
    return partial(LearnedExit, predictors, artifact.settings, threshold), artifact.settings.candidates


def _rule(config, artifacts, num_layers: int):
    make_policy = partial(RuleExit, rule_settings(config.rule), num_layers)
    make_policy()  # a bad first layer fails here, not when a generation starts
    return make_policy, RULE_CANDIDATES


register_exit(ExitKind("specee", _learned, options=("predictors", "threshold")))
register_exit(ExitKind("rule", _rule, options=("rule",)))
