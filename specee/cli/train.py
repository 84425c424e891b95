"""`specee train`: the drafter artifacts (n-gram table, EAGLE head, Kangaroo adapter, exit
predictors) and the copy prior, each trained on the dense weights."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..options import non_negative_int, positive_int
from . import loading
from .common import UsageError
from .loading import TRAINING_QUANTIZATION, add_model_options


def add_parser(sub) -> None:
    train = sub.add_parser("train", help="train drafter artifacts")
    artifacts = train.add_subparsers(dest="artifact", required=True)
    for add in (add_ngram, add_eagle, add_kangaroo, add_exits, add_copy_prior):
        add(artifacts)


def add_ngram(artifacts) -> None:
    ngram = artifacts.add_parser("ngram", help="a Katz-backoff n-gram table for the ngram, staged and auto drafters")
    add_model_options(ngram)  # only answers are read (no gradients): the format users run, the fastest
    ngram.add_argument("--corpus", action="append", default=[], help="text or Spec-Bench .jsonl file (repeatable)")
    ngram.add_argument("--dataset", action="append", default=[], help="registry dataset whose prompts to use")
    ngram.add_argument("--sharegpt", type=non_negative_int, default=0,
                       help="also the first user turns of N ShareGPT conversations (none a benchmark prompt)")
    ngram.add_argument("--generate", action="store_true", help="train on the model's own answers to the prompts")
    ngram.add_argument("--skip-first", type=non_negative_int, default=20,
                       help="leave out each category's first N (reported and tuned on)")
    ngram.add_argument("--limit", type=positive_int, help="prompts per category")
    ngram.add_argument("--max-tokens", type=positive_int, default=128, help="answer length with --generate")
    ngram.add_argument("--order", type=positive_int, default=3)
    ngram.add_argument("--out", required=True, help="output file")


def add_eagle(artifacts) -> None:
    eagle = artifacts.add_parser("eagle", help="an EAGLE-style feature head for --spec-method eagle")
    add_training_options(eagle, minutes=30.0)
    eagle.add_argument("--resume", action="store_true", help="continue from OUT's checkpoint (.ckpt)")
    eagle.add_argument("--init", help="go on training this head (a second stage; keeps its vocabulary and settings)")
    eagle.add_argument("--unroll", type=positive_int, default=1,
                       help="draft levels per training step, the head reading its own estimates (default 1)")
    for name, kind, text in (("depth", positive_int, "deepest draft node"), ("width", positive_int,
                             "candidates per expanded node"), ("budget", positive_int, "draft nodes verified per pass"),
                             ("min-prob", float, "stop growing below this path probability")):
        eagle.add_argument(f"--{name}", type=kind, help=f"drafting default stored in the artifact: {text}")


def add_kangaroo(artifacts) -> None:
    kangaroo = artifacts.add_parser("kangaroo", help="a Kangaroo adapter on the target's first layers for "
                                    "--spec-method kangaroo")
    add_training_options(kangaroo, minutes=20.0)
    kangaroo.add_argument("--resume", action="store_true", help="continue from OUT's checkpoint (.ckpt)")
    kangaroo.add_argument("--layers", type=positive_int, default=2,
                          help="l: the target's first layers the drafter shares (default 2)")
    kangaroo.add_argument("--eta", type=float, default=0.6,
                          help="drafting default stored in the artifact: stop after a token whose top-1 probability "
                               "is below this (default 0.6)")
    kangaroo.add_argument("--gamma", type=positive_int, default=6,
                          help="drafting default stored in the artifact: most draft tokens per step (default 6)")


def add_exits(artifacts) -> None:
    exits = artifacts.add_parser("exits", help="per-layer early-exit predictors for --exit specee")
    add_training_options(exits, minutes=5.0, tokens=60_000, epochs=30)
    exits.add_argument("--candidates", type=positive_int, default=4, help="K: the drafter's guesses per token (default 4)")
    exits.add_argument("--ngram-model", help="the n-gram table candidates come from (default: the one bundled for the "
                                             "model's tokenizer); decoding then needs the same --ngram-model")
    exits.add_argument("--fidelity", type=float, default=0.99,
                       help="the stored threshold is the lowest whose held-out exit fidelity reaches this (default 0.99)")
    exits.add_argument("--coverage", type=float, default=0.9,
                       help="offline layers: the most used, taking this share of held-out exits (default 0.9)")
    exits.add_argument("--balance-classes", action="store_true",
                       help="weight each layer's positives by its negatives/positives ratio (default: calibrated "
                            "outputs, the threshold handles the imbalance)")


def add_copy_prior(artifacts) -> None:
    prior = artifacts.add_parser("copy-prior", help="measure prompt lookup's copy hit rate by match length "
                                 "(the prior of drafters/copy_reliability.py)")
    add_model_options(prior, TRAINING_QUANTIZATION)
    prior.add_argument("--dataset", action="append", required=True, help="dataset whose prompts to answer (repeatable)")
    prior.add_argument("--skip-first", type=non_negative_int, default=5, help="leave out each category's first N (reported)")
    prior.add_argument("--limit", type=positive_int, default=5, help="prompts per category")
    prior.add_argument("--max-tokens", type=positive_int, default=128, help="longest answer")


def add_training_options(p: argparse.ArgumentParser, minutes: float, tokens: int = 400_000, epochs: int = 10) -> None:
    add_model_options(p, TRAINING_QUANTIZATION)
    p.add_argument("--out", required=True, help="output file")
    p.add_argument("--corpus", action="append", default=[], help="text or Spec-Bench .jsonl file (repeatable)")
    p.add_argument("--no-sharegpt", action="store_true", help="leave out the ShareGPT conversations")
    p.add_argument("--tokens", type=positive_int, default=tokens, help=f"corpus tokens (default {tokens})")
    p.add_argument("--minutes", type=float, default=minutes, help=f"training time after collection (default {minutes:g})")
    p.add_argument("--epochs", type=positive_int, default=epochs, help=f"most passes over the corpus (default {epochs})")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 0.001)")
    p.add_argument("--seed", type=int, default=0)


def check_training_options(args) -> None:
    if not args.minutes > 0:
        raise UsageError(f"--minutes must be > 0, got {args.minutes}")
    if args.no_sharegpt and not args.corpus:
        raise UsageError("--no-sharegpt needs --corpus FILE: there would be nothing to train on")
    if not args.lr > 0:
        raise UsageError(f"--lr must be > 0, got {args.lr}")


def run(args) -> int:
    if args.artifact == "copy-prior":
        from ..train.copy_prior import measure_copy_prior
        from ..train.ngram import dataset_prompts

        measure_copy_prior(loading.load(args), dataset_prompts(args.dataset, args.skip_first, args.limit), args.max_tokens)
        return 0
    trainers = {"eagle": train_eagle, "kangaroo": train_kangaroo, "exits": train_exits}
    if args.artifact in trainers:
        return trainers[args.artifact](args)
    from ..train.ngram import train_ngram

    train_ngram(
        loading.load(args), Path(args.out), corpus=args.corpus, datasets=args.dataset, generate=args.generate,
        skip_first=args.skip_first, limit=args.limit, max_tokens=args.max_tokens, order=args.order,
        sharegpt=args.sharegpt,
    )
    return 0


def train_eagle(args) -> int:
    from ..drafters.eagle import EagleArtifact, EagleSettings
    from ..train.eagle import EagleTrainConfig
    from ..train.eagle import train_eagle as train

    check_training_options(args)
    if args.min_prob is not None and not 0 <= args.min_prob <= 1:
        raise UsageError(f"--min-prob must be in [0, 1], got {args.min_prob}")
    engine = loading.load(args)
    init = EagleArtifact.load(args.init, engine.model) if args.init else None
    defaults = init.settings if init else EagleSettings()
    settings = EagleSettings(*(getattr(args, name) or getattr(defaults, name) for name in ("depth", "width", "budget")),
                             args.min_prob if args.min_prob is not None else defaults.min_prob)
    config = EagleTrainConfig(tokens=args.tokens, minutes=args.minutes, epochs=args.epochs, seed=args.seed,
                              unroll=args.unroll, lr=args.lr)
    train(engine, Path(args.out), args.corpus, not args.no_sharegpt, config, args.resume, settings, init)
    return 0


def train_kangaroo(args) -> int:
    from ..drafters.kangaroo import KangarooSettings
    from ..train.kangaroo import KangarooTrainConfig
    from ..train.kangaroo import train_kangaroo as train

    check_training_options(args)
    if not 0 <= args.eta <= 1:
        raise UsageError(f"--eta must be in [0, 1], got {args.eta}")
    engine = loading.load(args)
    total = engine.model.config.num_hidden_layers
    if args.layers >= total:
        raise UsageError(f"--layers must be in 1..{total - 1} for this model, got {args.layers}")
    config = KangarooTrainConfig(tokens=args.tokens, minutes=args.minutes, epochs=args.epochs, seed=args.seed,
                                 lr=args.lr)
    train(engine, Path(args.out), KangarooSettings(args.layers, args.eta, args.gamma), args.corpus,
          not args.no_sharegpt, config, args.resume)
    return 0


def train_exits(args) -> int:
    from ..strategies.builder import exit_candidates
    from ..train.exits import ExitTrainConfig
    from ..train.exits import train_exits as train

    check_training_options(args)
    for name in ("fidelity", "coverage"):
        if not 0 < getattr(args, name) <= 1:
            raise UsageError(f"--{name} must be in (0, 1], got {getattr(args, name)}")
    engine = loading.load(args)
    config = ExitTrainConfig(tokens=args.tokens, minutes=args.minutes, epochs=args.epochs, lr=args.lr,
                             fidelity=args.fidelity, coverage=args.coverage, seed=args.seed,
                             balance_classes=args.balance_classes)
    train(engine, Path(args.out), exit_candidates(engine.artifacts, args.candidates, args.ngram_model), args.corpus,
          not args.no_sharegpt, config)
    return 0
