"""`specee train eagle`: fit an EAGLE-style feature head to the target's own hidden states.

1. Collect: run the target over chat conversations (its chat template, teacher forcing over
   prompts and responses) and keep its last-layer states (fp16) and how often each token is its
   top choice. Saved under the cache folder, so a resumed run does not collect again.
2. Reduced vocabulary: the fewest most-chosen tokens that cover `vocab_coverage` of the target's
   top choices on the corpus.
3. Train: AdamW with warm-up and cosine decay (over the steps or the time budget), gradient clipping, a fixed seed, resumable
   checkpoints. Loss (EAGLE's): smooth-L1 between the head's estimate and the target's next state,
   (both divided by the states' RMS) plus `cls_weight` x soft cross-entropy against the target's
   distribution over the reduced vocabulary.
"""
from __future__ import annotations

import hashlib
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..drafters.eagle import EagleArtifact, EagleHead, EagleSettings, new_head_cache
from ..engine import Engine
from ..model.fingerprint import weights_fingerprint
from ..model.llama import Transformer
from ..model.loading import cache_root
from .corpus import SHAREGPT_LICENCE, benchmark_keys, sharegpt_conversations, sharegpt_path, without_benchmarks
from .ngram import file_sequences


EVAL_DEPTH = 4  # held-out agreement is reported for draft depths 1..EVAL_DEPTH


@dataclass
class EagleTrainConfig:
    tokens: int = 400_000  # corpus tokens to collect
    chunk: int = 512  # longest training sequence
    minutes: float = 30.0  # training time, after collection
    epochs: int = 10  # at most
    lr: float = 1e-3
    warmup_steps: int = 50
    clip: float = 0.5
    cls_weight: float = 0.5
    vocab_coverage: float = 0.99
    held_out: float = 0.02  # share of chunks kept for the accuracy check
    checkpoint_every: int = 100  # steps
    unroll: int = 1  # draft levels per training step (>1: EAGLE-3's training-time test)
    unroll_decay: float = 0.8  # weight of level k: decay^(k-1)
    seed: int = 0


@dataclass
class Collected:
    ids: list[torch.Tensor]  # per chunk [T] token ids
    states: list[torch.Tensor]  # per chunk [T, hidden] fp16: the target's last-layer states
    top_counts: torch.Tensor  # [vocab] how often each token was the target's top choice


def corpus_sequences(engine: Engine, corpus_files: list[str], use_sharegpt: bool, limit_tokens: int,
                     chunk: int) -> tuple[list[list[int]], dict]:
    """Token chunks of at most `chunk` tokens, up to `limit_tokens` in all, and what they came from."""
    sequences = [seq for path in corpus_files for seq in file_sequences(engine, Path(path))]
    info = {"files": [str(p) for p in corpus_files]}
    if use_sharegpt:
        dropped = [0]
        keys = benchmark_keys()
        conversations = 0
        budget = limit_tokens - sum(len(s) for s in sequences)
        for conversation in without_benchmarks(sharegpt_conversations(sharegpt_path()), keys, dropped):
            if budget <= 0:
                break
            text = engine.tokenizer.apply_chat_template(conversation, add_generation_prompt=False)
            ids = engine.tokenizer.encode(text, add_special_tokens=False)
            sequences.append(ids)
            budget -= len(ids)
            conversations += 1
        info.update(sharegpt=SHAREGPT_LICENCE, conversations=conversations, dropped_as_benchmark=dropped[0])
    chunks = [seq[start:start + chunk] for seq in sequences for start in range(0, len(seq), chunk)]
    chunks = [c for c in chunks if len(c) >= 2]
    kept, total = [], 0
    for c in chunks:
        if total >= limit_tokens:
            break
        kept.append(c)
        total += len(c)
    if not kept:
        raise ValueError("nothing to train on: the corpus is empty")
    info["tokens"] = total
    return kept, info


def collect(model: Transformer, chunks: list[list[int]]) -> Collected:
    ids_out, states_out = [], []
    top_counts = torch.zeros(model.config.vocab_size, dtype=torch.long)
    with torch.inference_mode():
        for chunk in tqdm(chunks, desc="collecting target states", unit="chunk", file=sys.stderr):
            ids = torch.tensor(chunk, device=model.device)
            cache = model.new_cache(len(chunk))
            h = model.hidden(ids, torch.arange(len(chunk), device=model.device), cache)
            top_counts += torch.bincount(model.logits(model.norm(h)).argmax(-1).cpu(), minlength=len(top_counts))
            ids_out.append(ids.cpu())
            states_out.append(h.to("cpu", torch.float16))
    return Collected(ids_out, states_out, top_counts)


def choose_vocabulary(top_counts: torch.Tensor, coverage: float) -> tuple[torch.Tensor, dict]:
    """The fewest most-chosen tokens covering `coverage` of the target's top choices, and the
    coverage of a few sizes (recorded in the artifact)."""
    counts, order = top_counts.sort(descending=True)
    cumulative = counts.cumsum(0).double() / counts.sum()
    size = int((cumulative < coverage).sum()) + 1
    table = {n: float(cumulative[min(n, len(cumulative)) - 1]) for n in (1024, 2048, 4096, 8192, 16384, 32768)}
    return order[:size].clone(), {"size": size, "coverage": float(cumulative[size - 1]), "coverage_by_size": table}


def features_file(engine: Engine, info: dict, chunk: int) -> Path:
    key = hashlib.sha256(repr((weights_fingerprint(engine.model), sorted(info.items()), chunk)).encode()).hexdigest()[:16]
    return cache_root() / f"eagle-states-{key}.pt"


def train_eagle(engine: Engine, out: Path, corpus_files: list[str] = (), use_sharegpt: bool = True,
                config: EagleTrainConfig | None = None, resume: bool = False,
                settings: EagleSettings | None = None, init: EagleArtifact | None = None) -> EagleArtifact:
    """Collect, choose the vocabulary, train and save. `init`: go on training that head (a second
    stage, e.g. with `unroll`), keeping its vocabulary and, unless given, its drafting settings."""
    cfg = config or EagleTrainConfig()
    began = time.perf_counter()
    model = engine.model
    chunks, info = corpus_sequences(engine, list(corpus_files), use_sharegpt, cfg.tokens, cfg.chunk)
    stored = features_file(engine, info, cfg.chunk)
    if stored.is_file():
        data = Collected(**torch.load(stored, weights_only=True))
    else:
        data = collect(model, chunks)
        stored.parent.mkdir(parents=True, exist_ok=True)
        torch.save(vars(data), stored)
    collect_s = time.perf_counter() - began
    if init is None:
        vocab, vocab_info = choose_vocabulary(data.top_counts, cfg.vocab_coverage)
    else:
        vocab, vocab_info = init.vocab, init.info.get("vocabulary", {"size": len(init.vocab), "coverage": float("nan")})
    print(f"{info['tokens']} tokens in {len(chunks)} chunks, states ready in {collect_s / 60:.1f} min; reduced "
          f"vocabulary {vocab_info['size']} tokens ({vocab_info['coverage']:.1%} of the target's top choices)",
          file=sys.stderr)

    checkpoint = out.with_suffix(".ckpt")
    head, fitted = fit_head(model, data, vocab, cfg, checkpoint, resume, init.head_state if init else None)
    info.update(model=str(engine.source.name) if engine.source else "", collect_minutes=round(collect_s / 60, 1),
                vocabulary=vocab_info, config=asdict(cfg), **fitted)
    if init is not None:  # the earlier stage's figures, so the artifact tells the whole training cost
        info["first_stage"] = {k: v for k, v in init.info.items() if k != "first_stage"}
        info["total_minutes"] = round(sum(stage.get("collect_minutes", 0) + stage.get("train_minutes", 0)
                                          for stage in (init.info, info)), 1)
    settings = settings or (init.settings if init else EagleSettings())
    artifact = EagleArtifact(head.state_dict(), vocab, weights_fingerprint(model), settings, info)
    out.parent.mkdir(parents=True, exist_ok=True)
    artifact.save(out)
    checkpoint.unlink(missing_ok=True)
    print(f"EAGLE head: {fitted['steps']} steps in {fitted['train_minutes']} min, held-out top-1 agreement with the "
          f"target {fitted['held_out_top1_agreement']:.1%} -> {out} ({out.stat().st_size / 2**20:.1f} MiB)",
          file=sys.stderr)
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
    order = list(range(len(data.ids)))
    random.Random(cfg.seed).shuffle(order)
    held = max(1, int(len(order) * cfg.held_out))
    held_out, train_set = order[:held], order[held:] or order
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    total_steps = cfg.epochs * len(train_set)
    step = 0
    if resume and checkpoint is not None and checkpoint.is_file():
        saved = torch.load(checkpoint, weights_only=True)
        head.load_state_dict(saved["head"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
        print(f"resumed from {checkpoint} at step {step}", file=sys.stderr)

    def loss_of(index: int, passes: int) -> tuple[torch.Tensor, list[float]]:
        ids, states = data.ids[index].to(model.device), data.states[index].to(model.device).float()
        return unrolled_loss(head, model, ids, states, scorer, scale, passes, cfg.cls_weight, cfg.unroll_decay)

    model.requires_grad_(False)
    train_began = time.perf_counter()
    deadline = train_began + cfg.minutes * 60
    losses: list[float] = []
    epoch_order: list[int] | None = None
    bar = tqdm(total=total_steps, initial=step, desc="training EAGLE head", unit="step", file=sys.stderr)
    while step < total_steps and time.perf_counter() < deadline:
        epoch, within = divmod(step, len(train_set))
        if epoch_order is None or within == 0:
            epoch_order = random.Random(cfg.seed + epoch).sample(train_set, len(train_set))
        index = epoch_order[within]
        # Warm-up, then cosine decay over whichever runs out first: the steps or the time.
        progress = min(1.0, max(step / total_steps, (time.perf_counter() - train_began) / (cfg.minutes * 60)))
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) * 0.5 * (1 + math.cos(math.pi * progress))
        loss, _ = loss_of(index, cfg.unroll)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.clip)
        optimizer.step()
        step += 1
        losses.append(loss.item())
        bar.update(1)
        if step % 20 == 0:
            bar.set_postfix(loss=f"{sum(losses[-20:]) / 20:.3f}")
        if checkpoint is not None and step % cfg.checkpoint_every == 0:
            torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, checkpoint)
    bar.close()
    with torch.no_grad():
        by_pass = [loss_of(i, EVAL_DEPTH)[1] for i in held_out]
        agreement = [sum(row[k] for row in by_pass) / len(by_pass) for k in range(len(by_pass[0]))]
    train_s = time.perf_counter() - train_began
    return head, dict(
        steps=step, epochs=round(step / len(train_set), 2), train_minutes=round(train_s / 60, 1),
        first_loss=round(sum(losses[:10]) / len(losses[:10]), 4) if losses else None,
        final_loss=round(sum(losses[-50:]) / len(losses[-50:]), 4) if losses else None,
        held_out_top1_agreement=round(agreement[0], 4),
        held_out_top1_agreement_by_depth=[round(a, 4) for a in agreement],
    )


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
