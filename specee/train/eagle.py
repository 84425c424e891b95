"""`specee train eagle`: fit an EAGLE-style feature head to the target's own hidden states.

1. Collect the target's last-layer states over a chat corpus (collect.py).
2. Reduced vocabulary: the fewest most-chosen tokens that cover `vocab_coverage` of the target's
   top choices on the corpus.
3. Train (loop.py). Loss (EAGLE's): smooth-L1 between the head's estimate and the target's next
   state (both divided by the states' RMS) plus `cls_weight` x soft cross-entropy against the
   target's distribution over the reduced vocabulary; with `unroll` > 1, at every draft level.
"""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F

from ..drafters.eagle import EagleArtifact, EagleHead, EagleSettings
from ..engine import Engine
from ..model.fingerprint import weights_fingerprint
from ..model.llama import Transformer
from .collect import Collected, choose_vocabulary, target_states
from .loop import DrafterTrainConfig, GrowingKeys, fit, save_artifact, split_chunks


EVAL_DEPTH = 4  # held-out agreement is reported for draft depths 1..EVAL_DEPTH


@dataclass
class EagleTrainConfig(DrafterTrainConfig):
    cls_weight: float = 0.5
    unroll: int = 1  # draft levels per training step (>1: EAGLE-3's training-time test)
    unroll_decay: float = 0.8  # weight of level k: decay^(k-1)


def train_eagle(engine: Engine, out: Path, corpus_files: list[str] = (), use_sharegpt: bool = True,
                config: EagleTrainConfig | None = None, resume: bool = False,
                settings: EagleSettings | None = None, init: EagleArtifact | None = None) -> EagleArtifact:
    """Collect, choose the vocabulary, train and save. `init`: go on training that head (a second
    stage, e.g. with `unroll`), keeping its vocabulary and, unless given, its drafting settings."""
    cfg = config or EagleTrainConfig()
    model = engine.model
    data, info = target_states(engine, corpus_files, use_sharegpt, cfg.tokens, cfg.chunk)
    if init is None:
        vocab, vocab_info = choose_vocabulary(data.top_counts, cfg.vocab_coverage)
    else:
        vocab, vocab_info = init.vocab, init.info.get("vocabulary", {"size": len(init.vocab), "coverage": float("nan")})
    print(f"reduced vocabulary {vocab_info['size']} tokens ({vocab_info['coverage']:.1%} of the target's top "
          f"choices)", file=sys.stderr)
    checkpoint = out.with_suffix(".ckpt")
    head, fitted = fit_head(model, data, vocab, cfg, checkpoint, resume, init.weights if init else None)
    info.update(vocabulary=vocab_info, config=asdict(cfg), **fitted)
    if init is not None:  # the earlier stage's figures, so the artifact tells the whole training cost
        info["first_stage"] = {k: v for k, v in init.info.items() if k != "first_stage"}
        info["total_minutes"] = round(sum(stage.get("collect_minutes", 0) + stage.get("train_minutes", 0)
                                          for stage in (init.info, info)), 1)
    settings = settings or (init.settings if init else EagleSettings())
    artifact = EagleArtifact(head.state_dict(), vocab, weights_fingerprint(model), settings, info)
    save_artifact(artifact, out, checkpoint, "EAGLE head")
    return artifact


def fit_head(model: Transformer, data: Collected, vocab: torch.Tensor, cfg: EagleTrainConfig,
             checkpoint: Path | None = None, resume: bool = False, init: dict | None = None) -> tuple[EagleHead, dict]:
    """Train a head on collected states (a fresh one, or from the weights `init`); returns it and
    the training figures."""
    torch.manual_seed(cfg.seed)
    # States are large (RMS ~33 on the default model, some dimensions ~250): the regression is
    # taken on states divided by their RMS, so it does not drown the token loss.
    scale = float(torch.cat([s[:64] for s in data.states]).float().pow(2).mean().sqrt())
    head = EagleHead(model.config).to(model.device)
    if init is not None:
        head.load_state_dict({k: v.float() for k, v in init.items()})
    scorer = model.head_rows(vocab.to(model.device)).detach().float()  # [N, hidden]
    held_out, train_set = split_chunks(len(data.ids), cfg.held_out, cfg.seed)

    def loss_of(index: int, passes: int) -> tuple[torch.Tensor, list[float]]:
        ids, states = data.ids[index].to(model.device), data.states[index].to(model.device).float()
        return unrolled_loss(head, model, ids, states, scorer, scale, passes, cfg.cls_weight, cfg.unroll_decay)

    model.requires_grad_(False)
    figures = fit(head, lambda index: loss_of(index, cfg.unroll)[0], train_set, cfg, "training EAGLE head",
                  checkpoint, resume)
    with torch.no_grad():
        by_pass = [loss_of(i, EVAL_DEPTH)[1] for i in held_out]
        agreement = [sum(row[k] for row in by_pass) / len(by_pass) for k in range(len(by_pass[0]))]
    return head, figures | dict(
        held_out_top1_agreement=round(agreement[0], 4),
        held_out_top1_agreement_by_depth=[round(a, 4) for a in agreement],
    )


def unrolled_estimates(head: EagleHead, model: Transformer, ids: torch.Tensor, states: torch.Tensor,
                       passes: int) -> Iterator[tuple[int, torch.Tensor]]:
    """The head drafting `passes` levels deep over one chunk (EAGLE-3's training-time test):
    yields (k, estimates of the target's states at positions k..T-1) for k = 1..passes.

    Pass 1 is teacher-forced: position i reads the target's state at i - 1. Pass k reads the
    head's own pass-(k-1) estimate at i - 1, as a draft node k - 1 levels below the root does,
    and attends to what that node sees when drafting: pass-1 keys up to position i - k + 1 (the
    committed context) and one key of each pass 2..k on its path (its draft ancestors and itself)."""
    T = len(ids)
    cache = GrowingKeys()
    key_position, key_pass = [], []
    features = states[:-1]
    for k in range(1, min(passes, T - 1) + 1):
        positions = torch.arange(k, T, device=ids.device)
        key_position.append(positions)
        key_pass.append(torch.full_like(positions, k))
        mask = None
        if k > 1:
            kp, kk = torch.cat(key_position), torch.cat(key_pass)
            i = positions[:, None]
            mask = ((kk == 1) & (kp <= i - k + 1)) | ((kk > 1) & (kp == i - k + kk))
        estimate = head(model.embed(ids[k:]).detach().to(features.dtype), features, model.angles(positions), cache, mask)
        yield k, estimate
        features = estimate[:-1]  # the estimate at i is what a child node at i + 1 reads


def unrolled_loss(head: EagleHead, model: Transformer, ids: torch.Tensor, states: torch.Tensor, scorer: torch.Tensor,
                  scale: float, passes: int, cls_weight: float, decay: float) -> tuple[torch.Tensor, list[float]]:
    """EAGLE's loss at every draft level of `unrolled_estimates`, level k weighted decay^(k-1);
    also each level's top-1 agreement with the target."""
    total, weights, agreements = 0.0, 0.0, []
    for k, estimate in unrolled_estimates(head, model, ids, states, passes):
        wanted = states[k:]
        with torch.no_grad():
            target_probs = F.linear(model.norm(wanted).float(), scorer).softmax(-1)
        log_q = F.linear(model.norm(estimate), scorer).log_softmax(-1)
        regression = F.smooth_l1_loss(estimate / scale, wanted / scale)
        cross_entropy = -(target_probs * log_q).sum(-1).mean()
        weight = decay ** (k - 1)
        total = total + weight * (regression + cls_weight * cross_entropy)
        weights += weight
        agreements.append(float((log_q.argmax(-1) == target_probs.argmax(-1)).float().mean()))
    return total / weights, agreements
