"""Per-layer exit predictors: one small MLP per layer (3K -> 512 -> 1, ReLU, sigmoid) on the
exit features, all layers' weights stacked so training runs every layer in one batched op.

The artifact ties them to one model (fingerprint) and carries what training measured: the layers
worth running (offline ranking), the threshold, and the tokens that fill a candidate set when
the drafter offers fewer than K.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from ..artifact_header import ArtifactKind, TrainedArtifact
from ..artifact_store import ArtifactLoader, register_artifact

HIDDEN = 512


class ExitPredictors(nn.Module):
    """Predictors for layers 0 .. n - 1 (the output of layer i; the last layer needs none). Inputs
    are standardised with the training data's mean and spread, stored with the weights."""

    def __init__(self, num_layers: int, num_features: int, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_layers, num_features, hidden) * num_features ** -0.5)
        self.b1 = nn.Parameter(torch.zeros(num_layers, hidden))
        self.w2 = nn.Parameter(torch.randn(num_layers, hidden) * hidden ** -0.5)
        self.b2 = nn.Parameter(torch.zeros(num_layers))
        self.register_buffer("mean", torch.zeros(num_layers, num_features))
        self.register_buffer("std", torch.ones(num_layers, num_features))

    @property
    def num_layers(self) -> int:
        return self.w1.shape[0]

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """features [N, layers, F] -> exit logits [N, layers] (training: every layer at once)."""
        x = (features - self.mean) / self.std
        h = torch.relu(torch.einsum("nlf,lfh->nlh", x, self.w1) + self.b1)
        return torch.einsum("nlh,lh->nl", h, self.w2) + self.b2

    def layer(self, i: int, features: torch.Tensor) -> torch.Tensor:
        """The exit probability after layer i from features [T, F]: [T]."""
        x = (features - self.mean[i]) / self.std[i]
        return torch.sigmoid(torch.relu(x @ self.w1[i] + self.b1[i]) @ self.w2[i] + self.b2[i])


@dataclass
class ExitSettings:
    """Chosen by training and stored with the predictors; threshold is a default a run may change."""

    candidates: int = 4  # K
    threshold: float = 0.5
    layers: list[int] = field(default_factory=list)  # layers whose predictors run always (offline ranking)
    window: int = 5  # the scheduler's queue of recent exit layers
    radius: int = 2  # ... and the layers this close to them


@dataclass
class ExitArtifact(TrainedArtifact):
    """Trained exit predictors for one model (`weights`: ExitPredictors' state; `vocab`: the
    tokens the model emits most often, which fill a candidate set the drafter leaves short)."""

    HEADER: ClassVar[ArtifactKind] = ArtifactKind("specee-exits", 1, "exit predictor file", "specee train exits")
    SETTINGS: ClassVar[type] = ExitSettings

    def predictors(self, device: torch.device | str = "cpu") -> ExitPredictors:
        module = ExitPredictors(*self.weights["w1"].shape)  # [layers, features, hidden]
        module.load_state_dict({k: v.float() for k, v in self.weights.items()})
        return module.to(device).eval().requires_grad_(False)


def load_predictors(path, store) -> tuple[ExitArtifact, ExitPredictors]:
    """The artifact and its predictors on the model's device."""
    artifact = ExitArtifact.load(path, store.model)
    return artifact, artifact.predictors(store.model.device)


register_artifact(ArtifactLoader("exits", load_predictors, "--exit specee needs --exit-predictors FILE"))
