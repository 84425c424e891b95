"""The optimisation loop the trained self-drafters share: AdamW with warm-up and cosine decay (over
the steps or the time budget, whichever runs out first), gradient clipping, a fixed seed,
resumable checkpoints and a progress bar."""
from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from tqdm import tqdm


@dataclass
class LoopConfig:
    minutes: float = 30.0  # training time, after collection
    epochs: int = 10  # at most
    lr: float = 1e-3
    warmup_steps: int = 50
    clip: float = 0.5
    checkpoint_every: int = 100  # steps
    seed: int = 0


@dataclass
class DrafterTrainConfig(LoopConfig):
    """A drafter trained on the target's own states (collect.py) over a reduced vocabulary."""

    tokens: int = 400_000  # corpus tokens to collect
    chunk: int = 512  # longest training sequence
    vocab_coverage: float = 0.99  # the reduced vocabulary covers this share of the target's top choices
    held_out: float = 0.02  # share of chunks kept for the accuracy check


def split_chunks(count: int, held_out: float, seed: int) -> tuple[list[int], list[int]]:
    """(held-out chunk indices, training chunk indices): a seeded shuffle, at least one held out."""
    order = list(range(count))
    random.Random(seed).shuffle(order)
    held = max(1, int(count * held_out))
    return order[:held], order[held:] or order


def fit(module: nn.Module, loss_of: Callable[[int], torch.Tensor], train_set: list[int], cfg: LoopConfig,
        desc: str, checkpoint: Path | None = None, resume: bool = False) -> dict:
    """Minimise loss_of(chunk index) over `train_set` for cfg.epochs or cfg.minutes; returns the
    training figures (steps, epochs, minutes, mean loss at the start and at the end)."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=cfg.lr, weight_decay=0.0)
    total_steps = cfg.epochs * len(train_set)
    step = 0
    if resume and checkpoint is not None and checkpoint.is_file():
        saved = torch.load(checkpoint, weights_only=True)
        module.load_state_dict(saved["weights"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
        print(f"resumed from {checkpoint} at step {step}", file=sys.stderr)
    began = time.perf_counter()
    deadline = began + cfg.minutes * 60
    losses: list[float] = []
    epoch_order: list[int] | None = None
    bar = tqdm(total=total_steps, initial=step, desc=desc, unit="step", file=sys.stderr)
    while step < total_steps and time.perf_counter() < deadline:
        epoch, within = divmod(step, len(train_set))
        if epoch_order is None or within == 0:
            epoch_order = random.Random(cfg.seed + epoch).sample(train_set, len(train_set))
        progress = min(1.0, max(step / total_steps, (time.perf_counter() - began) / (cfg.minutes * 60)))
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) * 0.5 * (1 + math.cos(math.pi * progress))
        loss = loss_of(epoch_order[within])
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.clip)
        optimizer.step()
        step += 1
        losses.append(loss.item())
        bar.update(1)
        if step % 20 == 0:
            bar.set_postfix(loss=f"{sum(losses[-20:]) / 20:.3f}")
        if checkpoint is not None and step % cfg.checkpoint_every == 0:
            torch.save({"weights": module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, checkpoint)
    bar.close()
    return dict(
        steps=step, epochs=round(step / len(train_set), 2), train_minutes=round((time.perf_counter() - began) / 60, 1),
        first_loss=round(sum(losses[:10]) / len(losses[:10]), 4) if losses else None,
        final_loss=round(sum(losses[-50:]) / len(losses[-50:]), 4) if losses else None,
    )


def save_artifact(artifact, out: Path, checkpoint: Path, name: str) -> None:
    """Write a trained drafter, drop its checkpoint and say what was made."""
    out.parent.mkdir(parents=True, exist_ok=True)
    artifact.save(out)
    checkpoint.unlink(missing_ok=True)
    info = artifact.info
    print(f"{name}: {info['steps']} steps in {info['train_minutes']} min, held-out top-1 agreement with the target "
          f"{info['held_out_top1_agreement']:.1%} -> {out} ({out.stat().st_size / 2**20:.1f} MiB)", file=sys.stderr)


class GrowingKeys:
    """A KV cache for training: appends out of place, so every pass's keys stay differentiable."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, T, head_dim]
        self.keys = k if self.keys is None else torch.cat((self.keys, k), dim=1)
        self.values = v if self.values is None else torch.cat((self.values, v), dim=1)
        return self.keys, self.values


