"""`specee train kangaroo`: fit a Kangaroo adapter on the target's first l layers.

1. Collect the target's last-layer states over a chat corpus (collect.py; shared with the EAGLE
   head, so one collection serves both).
2. Reduced vocabulary, as for the EAGLE head.
3. Train (loop.py). Each step runs the chunk through the target's first l layers (no gradient),
   the adapter, the target's final norm and the reduced head, and minimises the soft
   cross-entropy against the target's own next-token distribution at the same position.
"""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..drafters.kangaroo import Adapter, KangarooArtifact, KangarooSettings
from ..engine import Engine
from ..model.fingerprint import weights_fingerprint
from ..model.llama import Transformer
from .collect import Collected, choose_vocabulary, target_states
from .loop import DrafterTrainConfig, GrowingKeys, fit, save_artifact, split_chunks


@dataclass
class KangarooTrainConfig(DrafterTrainConfig):
    minutes: float = 20.0


def train_kangaroo(engine: Engine, out: Path, settings: KangarooSettings, corpus_files: list[str] = (),
                   use_sharegpt: bool = True, config: KangarooTrainConfig | None = None,
                   resume: bool = False) -> KangarooArtifact:
    """Collect, choose the vocabulary, train an adapter on `settings.layers` shallow layers and save."""
    cfg = config or KangarooTrainConfig()
    model = engine.model
    total = model.config.num_hidden_layers
    if not 1 <= settings.layers < total:
        raise ValueError(f"--layers must be in 1..{total - 1} for this model, got {settings.layers}")
    data, info = target_states(engine, corpus_files, use_sharegpt, cfg.tokens, cfg.chunk)
    vocab, vocab_info = choose_vocabulary(data.top_counts, cfg.vocab_coverage)
    print(f"reduced vocabulary {vocab_info['size']} tokens ({vocab_info['coverage']:.1%} of the target's top "
          f"choices)", file=sys.stderr)
    checkpoint = out.with_suffix(".ckpt")
    adapter, fitted = fit_adapter(model, data, vocab, settings.layers, cfg, checkpoint, resume)
    info.update(vocabulary=vocab_info, config=asdict(cfg), **fitted)
    info["total_minutes"] = round(info["collect_minutes"] + info["train_minutes"], 1)
    artifact = KangarooArtifact(adapter.state_dict(), vocab, weights_fingerprint(model), settings, info)
    save_artifact(artifact, out, checkpoint, "Kangaroo adapter")
    return artifact


def fit_adapter(model: Transformer, data: Collected, vocab: torch.Tensor, layers: int, cfg: KangarooTrainConfig,
                checkpoint: Path | None = None, resume: bool = False) -> tuple[Adapter, dict]:
    """Train an adapter on the states after the target's first `layers` layers; returns it and
    the training figures (with its held-out top-1 agreement with the target)."""
    torch.manual_seed(cfg.seed)
    adapter = Adapter(model.config).to(model.device)
    scorer = model.head_rows(vocab.to(model.device)).detach().float()  # [N, hidden]
    held_out, train_set = split_chunks(len(data.ids), cfg.held_out, cfg.seed)

    def loss_of(index: int) -> tuple[torch.Tensor, float]:
        ids, states = data.ids[index].to(model.device), data.states[index].to(model.device).float()
        log_q = adapter_log_probs(adapter, model, ids, layers, scorer)
        with torch.no_grad():
            target_probs = F.linear(model.norm(states), scorer).softmax(-1)
        agreement = float((log_q.argmax(-1) == target_probs.argmax(-1)).float().mean())
        return -(target_probs * log_q).sum(-1).mean(), agreement

    model.requires_grad_(False)
    figures = fit(adapter, lambda index: loss_of(index)[0], train_set, cfg, "training Kangaroo adapter",
                  checkpoint, resume)
    with torch.no_grad():
        agreement = sum(loss_of(i)[1] for i in held_out) / len(held_out)
    return adapter, figures | dict(held_out_top1_agreement=round(agreement, 4))


def adapter_log_probs(adapter: Adapter, model: Transformer, ids: torch.Tensor, layers: int,
                      scorer: torch.Tensor) -> torch.Tensor:
    """The drafter's log-probabilities over the reduced vocabulary at every position of a chunk,
    as drafting computes them: [T, N]."""
    positions = torch.arange(len(ids), device=ids.device)
    with torch.no_grad():
        shallow = model.hidden(ids, positions, model.new_cache(len(ids)), layers=range(layers))
    out = adapter(shallow, model.angles(positions), GrowingKeys())
    return F.linear(model.norm(out), scorer).log_softmax(-1)
