"""`specee train exits`: fit the per-layer exit predictors (SpecEE) for a model.

1. Run the model over a chat corpus disjoint from the benchmarks (teacher forcing, chunks as in
   collect.py), keeping every layer's output.
2. Candidates at every position: the drafter's top K guesses for the next token (the same drafter
   and the same filling-up as decoding uses), scored through the same features (exits/features.py).
3. Labels: a layer's full-vocabulary argmax, from the same normed state, equals the last layer's.
4. Train every layer's MLP at once (BCE, on all but the held-out chunks). Exits are rare at most
   layers; the outputs stay calibrated and step 5's threshold deals with the imbalance
   (`balance_classes` weights positives by each layer's negatives/positives ratio instead).
5. On the held-out chunks, replay the exit decision (the first layer whose predictor fires and
   whose argmax is a candidate): choose the threshold (the lowest on a grid whose exit fidelity
   reaches `fidelity`), then rank layers by exits and keep those that take `coverage` of them.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..engine import Engine
from ..exits.candidates import Candidates
from ..exits.features import layer_features
from ..exits.predictors import ExitArtifact, ExitPredictors, ExitSettings
from ..model.fingerprint import weights_fingerprint
from ..model.llama import Transformer
from .collect import cached, corpus_sequences
from .loop import split_chunks

THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98)


@dataclass
class ExitTrainConfig:
    tokens: int = 60_000  # corpus tokens (every layer's full head runs on each: the costly part)
    chunk: int = 512
    minutes: float = 5.0  # predictor training, after collection
    epochs: int = 30
    batch: int = 1024
    lr: float = 1e-3
    held_out: float = 0.1
    fidelity: float = 0.99  # the threshold is the lowest whose held-out exit fidelity reaches this
    coverage: float = 0.9  # offline ranking keeps the layers that take this share of exits
    # Weight each layer's positives by its negatives/positives ratio. Off by default: unweighted
    # BCE keeps the outputs calibrated, and the held-out threshold then handles the imbalance
    # (more exits at the same fidelity on the default model, BENCHMARKS.md).
    balance_classes: bool = False
    max_positive_weight: float = 50.0
    seed: int = 0


@dataclass
class ExitData:
    features: torch.Tensor  # [N, layers - 1, 3K]
    labels: torch.Tensor  # [N, layers - 1] bool: the layer's argmax is the last layer's
    in_candidates: torch.Tensor  # [N, layers - 1] bool: the layer's argmax is a candidate
    chunk_of: torch.Tensor  # [N] which chunk each position came from
    final_in_candidates: float  # share of positions whose last-layer argmax is a candidate


def chunk_data(model: Transformer, ids: list[int], candidates: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(features [T, L - 1, 3K], labels, in_candidates [T, L - 1], final in candidates [T])."""
    device = model.device
    positions = torch.arange(len(ids), device=device)
    cache = model.new_cache(len(ids))
    h = model.embed(torch.tensor(ids, device=device))
    states = [h]
    for i in range(model.config.num_hidden_layers):
        h = model.run_layers(h, positions, cache, layers=range(i, i + 1))
        states.append(h)
    rows = model.head_rows(candidates.flatten()).view(*candidates.shape, -1)  # [T, K, hidden]
    features = layer_features(model, states, rows)[:, :-1]
    tops = torch.stack([model.logits(model.norm(s)).argmax(-1) for s in states[1:]], dim=1)  # [T, L]
    labels = tops[:, :-1] == tops[:, -1:]
    in_candidates = (tops[:, :-1, None] == candidates[:, None, :]).any(-1)
    final_in = (tops[:, -1:] == candidates).any(-1)
    return features.cpu(), labels.cpu(), in_candidates.cpu(), final_in.cpu()


def collect_exit_data(model: Transformer, candidates: Candidates, chunks: list[list[int]]) -> ExitData:
    with torch.inference_mode():
        parts = [chunk_data(model, chunk, candidates.table(chunk, model.device))
                 for chunk in tqdm(chunks, desc="collecting exit features", unit="chunk", file=sys.stderr)]
    features, labels, in_candidates, final_in = (torch.cat(column) for column in zip(*parts))
    chunk_of = torch.cat([torch.full((len(p[0]),), i) for i, p in enumerate(parts)])
    return ExitData(features, labels, in_candidates, chunk_of, float(final_in.float().mean()))


def fit_predictors(data: ExitData, rows: torch.Tensor, cfg: ExitTrainConfig) -> tuple[ExitPredictors, dict]:
    """Train every layer's predictor on the positions `rows`; returns them and the figures."""
    torch.manual_seed(cfg.seed)
    x, y = data.features[rows], data.labels[rows].float()
    layers, num_features = x.shape[1], x.shape[2]
    module = ExitPredictors(layers, num_features)
    module.mean.copy_(x.mean(0))
    module.std.copy_(x.std(0).clamp_min(1e-4))
    positives = y.sum(0)
    weight = ((len(y) - positives) / positives.clamp_min(1)).clamp(1.0, cfg.max_positive_weight)
    if not cfg.balance_classes:
        weight = torch.ones_like(weight)
    optimizer = torch.optim.AdamW(module.parameters(), lr=cfg.lr, weight_decay=1e-4)
    steps_per_epoch = (len(x) + cfg.batch - 1) // cfg.batch
    total = cfg.epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, total)
    began, deadline = time.perf_counter(), time.perf_counter() + cfg.minutes * 60
    generator = torch.Generator().manual_seed(cfg.seed)
    losses: list[float] = []
    step = 0
    with tqdm(total=total, desc="training exit predictors", unit="step", file=sys.stderr) as bar:
        while step < total and time.perf_counter() < deadline:
            for batch in torch.randperm(len(x), generator=generator).split(cfg.batch):
                loss = F.binary_cross_entropy_with_logits(module(x[batch]), y[batch], pos_weight=weight)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                scheduler.step()
                losses.append(loss.item())
                step += 1
                bar.update(1)
                if step % 50 == 0:
                    bar.set_postfix(loss=f"{sum(losses[-50:]) / 50:.3f}")
                if step >= total or time.perf_counter() >= deadline:
                    break
    module.eval().requires_grad_(False)
    return module, dict(steps=step, epochs=round(step / steps_per_epoch, 2),
                        train_minutes=round((time.perf_counter() - began) / 60, 1),
                        first_loss=round(sum(losses[:10]) / max(1, len(losses[:10])), 4),
                        final_loss=round(sum(losses[-50:]) / max(1, len(losses[-50:])), 4))


def replay_exits(probs: torch.Tensor, in_candidates: torch.Tensor, labels: torch.Tensor, threshold: float,
                 active: torch.Tensor | None = None) -> dict:
    """The exit decision on recorded positions: each exits after the first (active) layer whose
    predictor output `probs` [N, L - 1] exceeds the threshold and whose argmax is a candidate."""
    fires = (probs > threshold) & in_candidates
    if active is not None:
        fires &= active
    exited = fires.any(1)
    layer = torch.where(exited, fires.float().argmax(1), torch.full_like(exited, probs.shape[1], dtype=torch.long))
    correct = labels.gather(1, layer.clamp(max=probs.shape[1] - 1)[:, None])[:, 0] & exited
    count = int(exited.sum())
    return dict(
        threshold=threshold, exit_rate=count / len(probs), fidelity=int(correct.sum()) / count if count else 1.0,
        avg_layers=float((layer + 1).float().mean()),  # layers run: exit after layer i runs i + 1
        per_layer=torch.bincount(layer[exited], minlength=probs.shape[1]).tolist(),
    )


def choose_settings(module: ExitPredictors, data: ExitData, rows: torch.Tensor, cfg: ExitTrainConfig,
                    candidates: int) -> tuple[ExitSettings, dict]:
    """Threshold and offline layers from the held-out positions `rows`."""
    with torch.no_grad():
        probs = torch.sigmoid(module(data.features[rows]))
    in_candidates, labels = data.in_candidates[rows], data.labels[rows]
    replays = [replay_exits(probs, in_candidates, labels, t) for t in THRESHOLDS]
    chosen = next((r for r in replays if r["fidelity"] >= cfg.fidelity), replays[-1])
    counts = torch.tensor(chosen["per_layer"], dtype=torch.float)
    order = counts.argsort(descending=True).tolist()
    kept, taken = [], 0.0
    for layer in order:
        if counts.sum() == 0 or taken >= cfg.coverage * counts.sum():
            break
        kept.append(layer)
        taken += float(counts[layer])
    settings = ExitSettings(candidates=candidates, threshold=chosen["threshold"], layers=sorted(kept))
    active = torch.zeros(probs.shape[1], dtype=torch.bool)
    active[kept] = True
    scheduled = replay_exits(probs, in_candidates, labels, chosen["threshold"], active)
    agreement = float((((probs > 0.5) == labels) | ~in_candidates).float().mean())
    return settings, dict(thresholds=[{k: v for k, v in r.items() if k != "per_layer"} for r in replays],
                          exits_per_layer=chosen["per_layer"], offline_layers=sorted(kept),
                          held_out_offline_only={k: v for k, v in scheduled.items() if k != "per_layer"},
                          held_out_agreement_at_half=round(agreement, 4))


def train_exits(engine: Engine, out: Path, candidates: Candidates, corpus_files: list[str] = (),
                use_sharegpt: bool = True, config: ExitTrainConfig | None = None) -> ExitArtifact:
    """Collect, train, choose the threshold and layers, save. `candidates` are made exactly as
    decoding makes them (strategies.builder.exit_candidates)."""
    cfg = config or ExitTrainConfig()
    model = engine.model
    began = time.perf_counter()
    chunks, info = corpus_sequences(engine, list(corpus_files), use_sharegpt, cfg.tokens, cfg.chunk)
    # The features depend on the model, the corpus, the chunking and the candidates.
    key = (weights_fingerprint(model), sorted(info.items()), cfg.chunk, candidates.k, candidates.fallback)
    data = cached("exit-data", key, ExitData, lambda: collect_exit_data(model, candidates, chunks))
    info["collect_minutes"] = round((time.perf_counter() - began) / 60, 1)
    held, trained = split_chunks(len(chunks), cfg.held_out, cfg.seed)
    held_rows = torch.isin(data.chunk_of, torch.tensor(held)).nonzero()[:, 0]
    train_rows = torch.isin(data.chunk_of, torch.tensor(trained)).nonzero()[:, 0]
    module, fitted = fit_predictors(data, train_rows, cfg)
    settings, chosen = choose_settings(module, data, held_rows, cfg, candidates.k)
    info.update(config=asdict(cfg), final_in_candidates=round(data.final_in_candidates, 4),
                positive_share_per_layer=[round(v, 4) for v in data.labels.float().mean(0).tolist()], **fitted, **chosen)
    info["total_minutes"] = round(info["collect_minutes"] + info["train_minutes"], 1)
    artifact = ExitArtifact({k: v for k, v in module.state_dict().items()}, torch.tensor(candidates.fallback),
                            weights_fingerprint(model), settings, info)
    out.parent.mkdir(parents=True, exist_ok=True)
    artifact.save(out)
    summary = chosen["held_out_offline_only"]
    print(f"exit predictors: threshold {settings.threshold}, {len(settings.layers)} offline layers "
          f"{settings.layers}; held out: {summary['exit_rate']:.1%} of tokens exit, fidelity "
          f"{summary['fidelity']:.2%}, {summary['avg_layers']:.1f} layers per token of "
          f"{model.config.num_hidden_layers} -> {out} ({out.stat().st_size / 2**20:.2f} MiB)", file=sys.stderr)
    return artifact
