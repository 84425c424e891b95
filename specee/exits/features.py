"""Exit features: what a layer's state says about the drafter's K candidate tokens.

After layer i the state (normed by the model's final norm, as the head reads it) is scored
against the head rows of the K candidates: K logits, their softmax over the K alone, and the
change of that softmax since the layer below (i - 1; the embeddings for layer 0). "The layer
below" means the same at training and at inference: a strategy computes the features of every
layer a predictor reads and of the layer under it, whichever layers it skips.
"""
from __future__ import annotations

import torch

from ..model.llama import Transformer


def candidate_logits(model: Transformer, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """h: [T, hidden] a layer's output (before the final norm); rows: [T, K, hidden] the head rows
    of each position's candidates. Returns [T, K]."""
    return torch.einsum("th,tkh->tk", model.norm(h), rows)


def exit_features(logits: torch.Tensor, below: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [T, 3K], the candidates' softmax [T, K]) from a layer's candidate logits [T, K]
    and the softmax of the layer below [T, K]."""
    probs = logits.softmax(-1)
    return torch.cat((logits, probs, probs - below), dim=-1), probs


def layer_features(model: Transformer, states: list[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """The slow reference: features after every layer from all states (embeddings first, then
    each layer's output: L + 1 of [T, hidden]). Returns [T, L, 3K]; layer i's row is after layer i."""
    probs = [candidate_logits(model, h, rows).softmax(-1) for h in states]
    out = []
    for i in range(1, len(states)):
        logits = candidate_logits(model, states[i], rows)
        out.append(exit_features(logits, probs[i - 1])[0])
    return torch.stack(out, dim=1)
