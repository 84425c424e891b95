"""The `specee` command line: generate, chat, serve, bench, bench-serve, train."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

EXIT_BAD_INPUT = 2


class UsageError(Exception):
    """Bad input from the user: printed as one line on stderr, exit code 2."""


def _int_from(low: int, name: str):
    """An argparse type: a whole number >= low."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {name}, got {value}")
        return value
    return parse


_positive_int = _int_from(1, "a positive integer")
_non_negative_int = _int_from(0, "a whole number >= 0")


def _replicas(text: str) -> int | str:
    return text if text == "auto" else _positive_int(text)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


# Trained artifacts are made on the dense weights (what the bundled ones were trained on, and what
# gradients flow through); they run in every format, matched by the dense weights' fingerprint.
TRAINING_QUANTIZATION = "none"


def _add_model_options(p: argparse.ArgumentParser, default_quantization: str = "auto") -> None:
    from .model.kernels import TIER_NAMES

    p.add_argument("--model", help="GGUF file or Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="fp32", help="fp32 or bf16 (default fp32)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--threads", type=_positive_int,
                   help="CPU threads (default: the physical cores this process may run on)")
    p.add_argument("--quantization", default=default_quantization,
                   help="weights: auto (on the CPU a GGUF file's own format, else int4; none on a GPU), none (dense "
                        "--dtype), int8 (per channel), int4 (groups of 32; head int8) or gguf (the GGUF file's own "
                        "Q4_0/Q4_1/Q4_K blocks as int4, Q5/Q6_K/Q8_0 as grouped int8); the quantized formats run on "
                        f"the CPU (default {default_quantization})")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="run on PyTorch's own CPU kernels instead of specee's compiled ones (built once per machine "
                        "into the cache folder): slower, and its greedy tokens may differ from the compiled run's")
    p.add_argument("--ctx-size", type=_positive_int, default=None,
                   help="the longest prompt plus answer a generation may hold, in tokens (default: the model's "
                        "context, at most 4096); the KV cache grows up to it, and the memory check counts it full")
    p.add_argument("--prefix-cache-mb", type=_non_negative_float, default=None,
                   help="memory for the prefix cache, which keeps earlier prompts' and answers' K/V so a "
                        "prompt that begins the same way prefills only the rest (default on the CPU kernels: the "
                        "model's K/V for 8192 tokens, at most an eighth of the available memory and 1024; "
                        "0 = off; off by default elsewhere)")
    p.add_argument("--cpu-tier", choices=("auto",) + TIER_NAMES, default=None,
                   help="which instruction set specee's kernels use: auto (the best this CPU runs; or $SPECEE_CPU_TIER), "
                        "or a lower tier to run and time it; every tier gives the same bits")


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    from .drafters.registry import METHODS  # importing the drafters registers the built-in methods
    from .strategies.config import add_flags

    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=_non_negative_int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    p.add_argument("--seed", type=int, help="random seed for sampling")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from the logit of every token already generated, in -2..2 (default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times its count so far from each generated token's logit, in -2..2 (default 0)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence (benchmarks)")
    add_flags(p, tuple(METHODS))


VERBOSE_HELP = "after each answer, list the passes by drafting method and auto's switches with their reasons"


def build_parser() -> argparse.ArgumentParser:

    parser = argparse.ArgumentParser(prog="specee", description="Fast LLM decoding on your machine.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_chat(sub)
    _add_serve(sub)
    _add_bench(sub)
    _add_bench_serve(sub)
    _add_train(sub)
    return parser


def _add_generate(sub) -> None:
    """`specee generate`: one prompt, its answer."""
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt", nargs="?", help="prompt text, or - to read stdin (the default when stdin is piped)")
    _add_model_options(gen)
    _add_sampling_options(gen)
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.add_argument("--json", action="store_true", help="end stdout with one JSON object of the result")
    gen.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    constraint = gen.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="SCHEMA",
                            help="the answer is JSON matching this schema (JSON text, or a file holding it); "
                                 "'{}' for any JSON object")
    constraint.add_argument("--regex", help="the answer matches this regular expression, whole")
    constraint.add_argument("--grammar", metavar="FILE", help="the answer follows this Lark grammar (llguidance's)")


def _add_chat(sub) -> None:
    """`specee chat`: an interactive conversation."""
    chat = sub.add_parser("chat", help="interactive conversation (empty line or Ctrl-D ends it)")
    _add_model_options(chat)
    _add_sampling_options(chat)
    chat.add_argument("--system", help="system message")
    chat.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)


def _add_serve(sub) -> None:
    """`specee serve`: the HTTP server, alone or on Ray Serve replicas."""
    from .batch import DEFAULT_MAX_BATCH, DEFAULT_PREFILL_CHUNK

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with a live page at /")
    _add_model_options(serve)
    _add_sampling_options(serve)  # the defaults of requests that leave these out
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=_non_negative_int, default=8000, help="port (default 8000)")
    serve.add_argument("--api-key", default=os.environ.get("SPECEE_API_KEY"),
                       help="require Authorization: Bearer KEY on /v1 routes (default: $SPECEE_API_KEY)")
    serve.add_argument("--max-queue", type=_positive_int, default=64,
                       help="requests that may wait; more get 503 with Retry-After (default 64)")
    serve.add_argument("--max-batch", type=_positive_int, default=DEFAULT_MAX_BATCH,
                       help="generations that share each pass of the model; more requests wait in the queue "
                            f"(default {DEFAULT_MAX_BATCH})")
    serve.add_argument("--prefill-chunk", type=_positive_int, default=DEFAULT_PREFILL_CHUNK,
                       help="the most prompt tokens of a new request in one shared pass, so a long prompt does "
                            f"not stall the others (default {DEFAULT_PREFILL_CHUNK})")
    serve.add_argument("--request-timeout", type=float, default=300.0,
                       help="seconds a request may take, queueing included (default 300)")
    serve.add_argument("--body-timeout", type=float, default=30.0,
                       help="seconds a request's body may take to arrive; slower ones get 408 (default 30)")
    serve.add_argument("--keep-alive-timeout", type=float, default=5.0,
                       help="seconds an idle connection is kept open, and the most a request's headers may take "
                            "to arrive (uvicorn's --timeout-keep-alive; default 5)")
    serve.add_argument("--shutdown-grace", type=float, default=30.0,
                       help="after SIGTERM, seconds running requests may take to finish; streams still running "
                            "at the end get an error event and [DONE] (default 30)")
    cluster = serve.add_argument_group("scale-out on Ray Serve (pip install -e \".[cluster]\")")
    cluster.add_argument("--replicas", type=_replicas, default=None,
                         help="serve through Ray Serve with N replicas, each with its own engine on --threads cores, "
                              "or auto: as many as the load asks for, between --min-replicas and --max-replicas "
                              "(default: one process, no Ray)")
    cluster.add_argument("--min-replicas", type=_positive_int, default=1, help="--replicas auto: the fewest (default 1)")
    cluster.add_argument("--max-replicas", type=_positive_int, default=4, help="--replicas auto: the most (default 4)")
    cluster.add_argument("--target-ongoing", type=_positive_int, default=None,
                         help="--replicas auto: ongoing requests per replica to scale at (default: --max-batch)")
    cluster.add_argument("--routing", choices=("prefix", "fewest"), default="prefix",
                         help="--replicas: prefix sends a request whose prompt begins as a replica's recent ones did "
                              "to that replica (its prefix cache has them), unless it is busier than the others; "
                              "fewest: always the replica with the fewest ongoing requests (default prefix)")
    cluster.add_argument("--address", default=None,
                         help="with --replicas: join this Ray cluster (auto, or the head's host:port); default: "
                              "start a local Ray that stops with the command")


def _add_bench(sub) -> None:
    """`specee bench`: every mode's speed and quality."""
    bench = sub.add_parser("bench", help="speed and quality of every mode, side by side with baselines")
    _add_model_options(bench)
    bench.add_argument("--suite", default="quick", help="quick (a few minutes) or full (every category and dataset, about an hour on 2 cores; default quick)")
    bench.add_argument("--dataset", action="append", help="spec-bench, humaneval, mtbench, gsm8k, mmlu or a "
                       "Spec-Bench-format .jsonl file (repeatable; default: the suite's)")
    bench.add_argument("--num-prompts", type=_positive_int, help="prompts per category")
    bench.add_argument("--categories", help="comma-separated categories to keep")
    bench.add_argument("--max-tokens", type=_positive_int, help="tokens generated per prompt")
    bench.add_argument("--modes", help="comma-separated modes (default: all registered modes and baselines); a "
                       "registered mode takes speculative options as name[key=value,...], e.g. hybrid-tree[tree_budget=6]")
    bench.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--ignore-eos", action="store_true",
                       help="fixed-length runs: generate --max-tokens past EOS (default: stop at EOS, as a user would)")
    bench.add_argument("--skip-first", type=_non_negative_int, default=0,
                       help="leave out each category's first N prompts: tune on --skip-first 5 --num-prompts 5, "
                            "report on the first prompts (default 0)")
    bench.add_argument("--repeats", type=_positive_int, default=1,
                       help="run every mode N times on each prompt, in rotated rounds, and count its fastest run "
                            "(other work on the machine only slows a run down) (default 1)")
    bench.add_argument("--out", default="bench-out", help="output folder (default bench-out)")


def _add_bench_serve(sub) -> None:
    """`specee bench-serve`: the server under load."""
    load = sub.add_parser("bench-serve", help="load-test `specee serve` side by side with llama.cpp's server: requests/s, "
                          "tokens/s, time to first token and peak memory at 1 to 16 clients")
    _add_model_options(load)
    load.add_argument("--url", help="a running specee server (default: start one with the model options)")
    load.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated client counts (default 1,2,4,8,16)")
    load.add_argument("--scenario", choices=["requests", "chat", "agent"], default="requests",
                      help="requests: short independent requests; chat: six-turn MT-Bench conversations that resend "
                           "their history; agent: a ~1,000-token system prompt and five tool-loop calls (default requests)")
    load.add_argument("--requests-per-client", type=_positive_int, default=2,
                      help="requests each client sends in the requests scenario (default 2)")
    load.add_argument("--conversations", type=_positive_int,
                      help="chat/agent: conversations per run, dealt round the clients (default: the most clients)")
    load.add_argument("--max-tokens", type=_positive_int, default=64, help="most tokens per answer (default 64)")
    load.add_argument("--modes", default="dense,hybrid-tree,llama.cpp",
                      help="comma-separated: dense, hybrid-tree, dense-no-prefix-cache (specee's modes), llama.cpp "
                           "(default dense,hybrid-tree,llama.cpp)")
    load.add_argument("--max-batch", type=_positive_int,
                      help="specee serve --max-batch: generations sharing each model pass (default: the server's)")
    load.add_argument("--parallel", type=_positive_int,
                      help="llama-server's slots, -np (default: the largest --concurrency)")
    load.add_argument("--llama-server", help="llama.cpp's llama-server executable (default: where "
                      "scripts/build_llama_server.sh installs it; without one, llama-cpp-python's server if installed)")
    load.add_argument("--rounds", type=_positive_int, default=1,
                      help="run specee's modes at every concurrency N times, interleaved, each keeping its fastest "
                           "round (default 1)")
    load.add_argument("--out", default="bench-serve.json", help="JSON output file, the plot beside it (default bench-serve.json)")


def _add_train(sub) -> None:
    """`specee train ngram|eagle|kangaroo|exits|copy-prior`."""
    train = sub.add_parser("train", help="train drafter artifacts")
    train_sub = train.add_subparsers(dest="artifact", required=True)
    ngram = train_sub.add_parser("ngram", help="a Katz-backoff n-gram table for the ngram/staged drafters")
    _add_model_options(ngram, TRAINING_QUANTIZATION)
    ngram.add_argument("--corpus", action="append", default=[], help="text or Spec-Bench .jsonl file (repeatable)")
    ngram.add_argument("--dataset", action="append", default=[], help="registry dataset whose prompts to use")
    ngram.add_argument("--generate", action="store_true", help="train on the model's own answers to the prompts")
    ngram.add_argument("--skip-first", type=_non_negative_int, default=20,
                       help="leave out each category's first N (reported and tuned on)")
    ngram.add_argument("--limit", type=_positive_int, help="prompts per category")
    ngram.add_argument("--max-tokens", type=_positive_int, default=128, help="answer length with --generate")
    ngram.add_argument("--order", type=_positive_int, default=3)
    ngram.add_argument("--out", required=True, help="output file")
    eagle = train_sub.add_parser("eagle", help="an EAGLE-style feature head for --spec-method eagle")
    _add_training_options(eagle, minutes=30.0)
    eagle.add_argument("--resume", action="store_true", help="continue from OUT's checkpoint (.ckpt)")
    eagle.add_argument("--init", help="go on training this head (a second stage; keeps its vocabulary and settings)")
    eagle.add_argument("--unroll", type=_positive_int, default=1,
                       help="draft levels per training step, the head reading its own estimates (default 1)")
    for name, kind, text in (("depth", _positive_int, "deepest draft node"), ("width", _positive_int,
                             "candidates per expanded node"), ("budget", _positive_int, "draft nodes verified per pass"),
                             ("min-prob", float, "stop growing below this path probability")):
        eagle.add_argument(f"--{name}", type=kind, help=f"drafting default stored in the artifact: {text}")
    kangaroo = train_sub.add_parser("kangaroo", help="a Kangaroo adapter on the target's first layers for "
                                    "--spec-method kangaroo")
    _add_training_options(kangaroo, minutes=20.0)
    kangaroo.add_argument("--resume", action="store_true", help="continue from OUT's checkpoint (.ckpt)")
    kangaroo.add_argument("--layers", type=_positive_int, default=2,
                          help="l: the target's first layers the drafter shares (default 2)")
    kangaroo.add_argument("--eta", type=float, default=0.6,
                          help="drafting default stored in the artifact: stop after a token whose top-1 probability "
                               "is below this (default 0.6)")
    kangaroo.add_argument("--gamma", type=_positive_int, default=6,
                          help="drafting default stored in the artifact: most draft tokens per step (default 6)")
    exits = train_sub.add_parser("exits", help="per-layer early-exit predictors for --exit specee")
    _add_training_options(exits, minutes=5.0, tokens=60_000, epochs=30)
    exits.add_argument("--candidates", type=_positive_int, default=4, help="K: the drafter's guesses per token (default 4)")
    exits.add_argument("--ngram-model", help="the n-gram table candidates come from (default: the one bundled for the "
                                             "model's tokenizer); decoding then needs the same --ngram-model")
    exits.add_argument("--fidelity", type=float, default=0.99,
                       help="the stored threshold is the lowest whose held-out exit fidelity reaches this (default 0.99)")
    exits.add_argument("--coverage", type=float, default=0.9,
                       help="offline layers: the most used, taking this share of held-out exits (default 0.9)")
    exits.add_argument("--balance-classes", action="store_true",
                       help="weight each layer's positives by its negatives/positives ratio (default: calibrated "
                            "outputs, the threshold handles the imbalance)")
    prior = train_sub.add_parser("copy-prior", help="measure prompt lookup's copy hit rate by match length "
                                 "(the prior of drafters/copy_reliability.py)")
    _add_model_options(prior, TRAINING_QUANTIZATION)
    prior.add_argument("--dataset", action="append", required=True, help="dataset whose prompts to answer (repeatable)")
    prior.add_argument("--skip-first", type=_non_negative_int, default=5, help="leave out each category's first N (reported)")
    prior.add_argument("--limit", type=_positive_int, default=5, help="prompts per category")
    prior.add_argument("--max-tokens", type=_positive_int, default=128, help="longest answer")


def _add_training_options(p: argparse.ArgumentParser, minutes: float, tokens: int = 400_000, epochs: int = 10) -> None:
    _add_model_options(p, TRAINING_QUANTIZATION)
    p.add_argument("--out", required=True, help="output file")
    p.add_argument("--corpus", action="append", default=[], help="text or Spec-Bench .jsonl file (repeatable)")
    p.add_argument("--no-sharegpt", action="store_true", help="leave out the ShareGPT conversations")
    p.add_argument("--tokens", type=_positive_int, default=tokens, help=f"corpus tokens (default {tokens})")
    p.add_argument("--minutes", type=float, default=minutes, help=f"training time after collection (default {minutes:g})")
    p.add_argument("--epochs", type=_positive_int, default=epochs, help=f"most passes over the corpus (default {epochs})")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 0.001)")
    p.add_argument("--seed", type=int, default=0)


def _check_training_options(args) -> None:
    if not args.minutes > 0:
        raise UsageError(f"--minutes must be > 0, got {args.minutes}")
    if args.no_sharegpt and not args.corpus:
        raise UsageError("--no-sharegpt needs --corpus FILE: there would be nothing to train on")
    if not args.lr > 0:
        raise UsageError(f"--lr must be > 0, got {args.lr}")


def cmd_train(args) -> int:
    if args.artifact == "copy-prior":
        from .train.copy_prior import measure_copy_prior
        from .train.ngram import dataset_prompts

        measure_copy_prior(_load(args), dataset_prompts(args.dataset, args.skip_first, args.limit), args.max_tokens)
        return 0
    trainers = {"eagle": _train_eagle, "kangaroo": _train_kangaroo, "exits": _train_exits}
    if args.artifact in trainers:
        return trainers[args.artifact](args)
    from .train.ngram import train_ngram

    train_ngram(
        _load(args), Path(args.out), corpus=args.corpus, datasets=args.dataset, generate=args.generate,
        skip_first=args.skip_first, limit=args.limit, max_tokens=args.max_tokens, order=args.order,
    )
    return 0


def _train_eagle(args) -> int:
    from .drafters.eagle import EagleArtifact, EagleSettings
    from .train.eagle import EagleTrainConfig, train_eagle

    _check_training_options(args)
    if args.min_prob is not None and not 0 <= args.min_prob <= 1:
        raise UsageError(f"--min-prob must be in [0, 1], got {args.min_prob}")
    engine = _load(args)
    init = EagleArtifact.load(args.init, engine.model) if args.init else None
    defaults = init.settings if init else EagleSettings()
    settings = EagleSettings(*(getattr(args, name) or getattr(defaults, name) for name in ("depth", "width", "budget")),
                             args.min_prob if args.min_prob is not None else defaults.min_prob)
    config = EagleTrainConfig(tokens=args.tokens, minutes=args.minutes, epochs=args.epochs, seed=args.seed,
                              unroll=args.unroll, lr=args.lr)
    train_eagle(engine, Path(args.out), args.corpus, not args.no_sharegpt, config, args.resume, settings, init)
    return 0


def _train_kangaroo(args) -> int:
    from .drafters.kangaroo import KangarooSettings
    from .train.kangaroo import KangarooTrainConfig, train_kangaroo

    _check_training_options(args)
    if not 0 <= args.eta <= 1:
        raise UsageError(f"--eta must be in [0, 1], got {args.eta}")
    engine = _load(args)
    total = engine.model.config.num_hidden_layers
    if args.layers >= total:
        raise UsageError(f"--layers must be in 1..{total - 1} for this model, got {args.layers}")
    config = KangarooTrainConfig(tokens=args.tokens, minutes=args.minutes, epochs=args.epochs, seed=args.seed,
                                 lr=args.lr)
    train_kangaroo(engine, Path(args.out), KangarooSettings(args.layers, args.eta, args.gamma), args.corpus,
                   not args.no_sharegpt, config, args.resume)
    return 0


def _train_exits(args) -> int:
    from .strategies.builder import exit_candidates
    from .train.exits import ExitTrainConfig, train_exits

    _check_training_options(args)
    for name in ("fidelity", "coverage"):
        if not 0 < getattr(args, name) <= 1:
            raise UsageError(f"--{name} must be in (0, 1], got {getattr(args, name)}")
    engine = _load(args)
    config = ExitTrainConfig(tokens=args.tokens, minutes=args.minutes, epochs=args.epochs, lr=args.lr,
                             fidelity=args.fidelity, coverage=args.coverage, seed=args.seed,
                             balance_classes=args.balance_classes)
    train_exits(engine, Path(args.out), exit_candidates(engine.artifacts, args.candidates, args.ngram_model), args.corpus,
                not args.no_sharegpt, config)
    return 0


def cmd_bench(args) -> int:
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError('specee bench draws plots with matplotlib: pip install "specee[bench]"')
    from .eval.bench import BenchConfig, run_bench

    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {args.temperature}")
    # Commas inside brackets belong to a mode's options: "dense,hybrid-tree[tree_budget=6,tree_width=3]".
    split = lambda text: [x.strip() for x in re.split(r",(?![^\[]*\])", text) if x.strip()] if text else None  # noqa: E731
    config = BenchConfig(
        suite=args.suite, datasets=args.dataset, num_prompts=args.num_prompts, categories=split(args.categories),
        max_tokens=args.max_tokens, modes=split(args.modes), temperature=args.temperature, seed=args.seed,
        ignore_eos=args.ignore_eos, skip_first=args.skip_first, repeats=args.repeats,
        out=args.out, threads=args.threads or __import__("torch").get_num_threads(),
        command="specee " + " ".join(sys.argv[1:]),
    )
    config.resolved()  # reject an unknown suite before the model loads
    _validate_model_options(args)
    run_bench(_load(args), config, explicit_datasets=bool(args.dataset))
    return 0


def cmd_bench_serve(args) -> int:
    if importlib.util.find_spec("openai") is None:
        raise UsageError('specee bench-serve sends its requests with the openai client: pip install "specee[bench]"')
    from .eval.llama_cpp_server import model_gguf
    from .eval.serve_bench import SYSTEMS, ServeBenchConfig, run_serve_bench

    unknown = set(args.modes.split(",")) - set(SYSTEMS)
    if unknown:
        raise UsageError(f"unknown --modes {sorted(unknown)} (choose from {', '.join(SYSTEMS)})")
    try:
        concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        raise UsageError(f"--concurrency takes comma-separated client counts, got {args.concurrency!r}") from None
    if min(concurrency) < 1:
        raise UsageError(f"--concurrency counts must be positive, got {args.concurrency!r}")
    if args.llama_server and not Path(args.llama_server).is_file():
        raise UsageError(f"--llama-server {args.llama_server!r} is not a file (build it: bash scripts/build_llama_server.sh)")
    engine = _load(args)
    config = ServeBenchConfig(
        concurrency=concurrency, requests_per_client=args.requests_per_client, max_tokens=args.max_tokens,
        modes=args.modes.split(","), url=args.url, out=Path(args.out),
        threads=args.threads or __import__("torch").get_num_threads(), max_batch=args.max_batch, parallel=args.parallel,
        gguf=model_gguf(args.model), llama_server=Path(args.llama_server) if args.llama_server else None,
        scenario=args.scenario, conversations=args.conversations, rounds=args.rounds)
    model_flags = [f"--{name}={value}" for name, value in (("model", args.model), ("dtype", args.dtype),
                                                          ("device", args.device), ("quantization", args.quantization))
                   if value]
    model_flags += ([] if args.compile else ["--no-compile"]) + ([f"--cpu-tier={args.cpu_tier}"] if args.cpu_tier else [])
    run_serve_bench(engine, config, model_flags)
    return 0


def _sampling_kwargs(args) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty)


def _validate_sampling(args) -> None:
    """Checked before the model loads, so bad flags fail in milliseconds; sets args.config, the
    decoding configuration."""
    from .sampling import SamplingParams
    from .strategies.config import from_flags

    try:
        args.config = from_flags(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.max_tokens <= 0:
        raise UsageError(f"--max-tokens must be a positive integer, got {args.max_tokens}")
    if args.config.greedy_only and args.temperature > 0:
        raise UsageError("--exit inside speculative verification runs greedy only: use --temperature 0")
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)
    except ValueError as e:
        message = str(e)
        for name in ("top_p", "top_k", "presence_penalty", "frequency_penalty"):
            message = message.replace(name, "--" + name.replace("_", "-"))
        raise UsageError(message) from None
    if params.adjusts and args.config.exit.kind != "none":
        raise UsageError("early exits do not apply --presence-penalty or --frequency-penalty")
    _validate_model_options(args)


def _validate_model_options(args) -> None:
    from .loader import parse_device, parse_dtype
    from .model.kernels import requested_tier, supported_tiers
    from .model.quantize import check_quantization

    try:
        parse_dtype(args.dtype)
        check_quantization(args.quantization, parse_device(args.device))
        tier = requested_tier(args.cpu_tier)
        if tier not in supported_tiers():
            raise ValueError(f"CPU tier {tier} cannot run on this CPU (it runs {', '.join(supported_tiers())})")
    except ValueError as e:
        raise UsageError(str(e)) from None


def _load(args):
    from . import load

    from .model.cores import physical_cores

    started = time.perf_counter()
    args.threads = args.threads or physical_cores()
    engine = load(args.model, dtype=args.dtype, device=args.device, threads=args.threads, quantization=args.quantization,
                  compile=args.compile, cpu_tier=args.cpu_tier, ctx_size=args.ctx_size,
                  prefix_cache_mb=getattr(args, "prefix_cache_mb", None))
    print(_load_line(engine, time.perf_counter() - started), file=sys.stderr)
    return engine


def _load_line(engine, seconds: float) -> str:
    from .model.memory import kv_cache_bytes

    name = engine.source.name if engine.source is not None else "model"
    kv = kv_cache_bytes(engine.config, engine.context_length)
    return (f"specee: {name} loaded in {seconds:.1f} s: {engine.quantization} weights, {engine.model.weight_bytes / 2**30:.2f} "
            f"GiB read per token; context {engine.context_length} tokens (KV cache up to {kv / 2**30:.2f} GiB); "
            f"{__import__('torch').get_num_threads()} threads")


def _load_off_main_thread(args):
    """Load on a thread that ends before serving starts. OpenMP gives every thread that runs a
    parallel region a pool of its own, and libgomp slows every pool down once more threads are in
    pools than there are cores: a pool left on the main thread (which then only runs the HTTP loop)
    made the scheduler thread decode about 1.4x slower. A pool ends with its thread."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="specee-load") as pool:
        return pool.submit(_load, args).result()


def _speed_line(result, engine) -> str:
    s = result.stats
    kernels = f"compiled kernels ({engine.cpu_tier})" if engine.model.uses_kernels else "PyTorch kernels"
    speculative = f"; {s.mean_acceptance_length:.2f} tokens per target pass" if s.accept_lengths else ""
    cached = f" ({s.cached_tokens} from the prefix cache)" if s.cached_tokens else ""
    return (
        f"[{engine.quantization} weights, {kernels}; {result.prompt_tokens} prompt tokens{cached}, prefill {s.prefill_s:.2f} s; {result.completion_tokens} tokens "
        f"in {s.decode_s:.2f} s = {s.tokens_per_s:.1f} tokens/s{speculative}; finish: {result.finish_reason}]"
    )


def _choices(stats) -> str:
    """The passes by the method that drafted them, and auto's switches with the acceptance behind each."""
    passes = ", ".join(f"{method} {count}" for method, count in sorted(stats.method_passes.items(), key=lambda m: -m[1]))
    lines = [f"[passes by drafting method: {passes or 'none'}; {stats.switches} switches]"]
    if stats.drafters:  # auto's own counts, per drafter it chose
        counts = "; ".join(f"{name}: {c['passes']} passes, {c['drafted']} drafted, {c['accepted']} accepted"
                           for name, c in sorted(stats.drafters.items(), key=lambda d: -d[1]["passes"]))
        lines.append(f"[auto's drafters: {counts}]")
    for s in stats.switch_log:
        measured = ", ".join(f"{source} {rate:.0%}" for source, rate in s["acceptance"].items()) or "nothing yet"
        others, rows = s["sharing"]
        load = f", sharing the pass with {others} ({rows} rows)" if others else ""
        offer = s["offer"]
        why = "no draft offered" if offer is None else (
            f"best offer {offer['source']} x{offer['draft']}: {offer['expected']:.2f} tokens expected, "
            f"{offer['gain']:.2f}x a dense step's tokens per cost")
        if s.get("resting"):
            why = "recent drafts gave fewer tokens per cost than dense steps: resting"
        lines.append(f"  token {s['at']}: {s['from']} -> {s['to']} ({why} at a row cost of {s['row_cost']:.2f}{load}; "
                     f"accepted so far: {measured})")
    if stats.switches > len(stats.switch_log):
        lines.append(f"  ... {stats.switches - len(stats.switch_log)} more")
    return "\n".join(lines)


def read_prompt(argument: str | None) -> str:
    """The prompt text: the argument, or stdin when it is "-" or absent. A terminal is read only
    when asked with "-" (and says so); with no argument it is an error, not a silent wait."""
    if argument is not None and argument != "-":
        return argument
    if sys.stdin.isatty():
        if argument is None:
            raise UsageError('no prompt: give it as an argument, pipe it in, or pass "-" to type it (Ctrl-D ends it)')
        print("specee: reading the prompt from stdin until Ctrl-D", file=sys.stderr)
    return sys.stdin.read()


def _constraint(args):
    """The answer's grammar from --json-schema, --regex or --grammar, checked before the model loads."""
    from .grammar import Grammar, grammar_error

    try:
        if args.json_schema is not None:
            text = args.json_schema
            if not text.lstrip().startswith("{") and Path(text).is_file():
                text = Path(text).read_text()
            schema = json.loads(text) if text.strip() != "{}" else {"type": "object"}
            grammar = Grammar.json_schema(schema)
        elif args.regex is not None:
            grammar = Grammar.regex(args.regex)
        elif args.grammar is not None:
            grammar = Grammar.lark(Path(args.grammar).read_text())
        else:
            return None
    except json.JSONDecodeError as e:
        raise UsageError(f"--json-schema is neither a file nor JSON: {e}") from None
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None
    if error := grammar_error(grammar):
        raise UsageError(error)
    if args.config.exit.kind != "none":
        raise UsageError("early exits choose among a few candidates: they cannot follow a grammar")
    if args.ignore_eos:
        raise UsageError("a grammar ends the answer when it is complete: drop --ignore-eos")
    return grammar


def cmd_generate(args) -> int:
    _validate_sampling(args)
    grammar = _constraint(args)
    prompt = read_prompt(args.prompt)
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    engine = _load(args)
    stream = engine.stream(prompt, args.config, chat=not args.no_chat, grammar=grammar, **_sampling_kwargs(args))
    for event in stream:
        sys.stdout.write(event.text)
        sys.stdout.flush()
    result = stream.result
    sys.stdout.write("\n")
    print(_speed_line(result, engine), file=sys.stderr)
    if args.verbose:
        print(_choices(result.stats), file=sys.stderr)
    if args.json:
        print(json.dumps(result.to_dict() | {"cpu_tier": engine.cpu_tier}))
    return 0


def cmd_chat(args) -> int:
    _validate_sampling(args)
    engine = _load(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("specee chat: type a message; an empty line or Ctrl-D ends the conversation.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        stream = engine.stream(messages, args.config, **_sampling_kwargs(args))
        for event in stream:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        print(_speed_line(stream.result, engine), file=sys.stderr)
        if args.verbose:
            print(_choices(stream.result.stats), file=sys.stderr)
        messages.append({"role": "assistant", "content": stream.result.text})
    return 0


def cmd_serve(args) -> int:
    if any(importlib.util.find_spec(name) is None for name in ("fastapi", "uvicorn", "prometheus_client")):
        raise UsageError("specee serve needs its extra: pip install 'specee[serve]'")
    validate_serve_args(args)
    if args.replicas is not None:
        return _serve_on_ray(args)
    from .server.app import bind, model_id_of, serve

    try:
        listening = bind(args.host, args.port)  # a busy port fails now, not after the model loads
    except OSError as e:
        raise UsageError(str(e)) from None
    with listening:
        engine = _load_off_main_thread(args)
        serve(engine, server_config(args, model_id_of(engine)), listening)
    return 0


def validate_serve_args(args) -> None:
    _validate_sampling(args)
    for flag in ("request_timeout", "body_timeout", "keep_alive_timeout", "shutdown_grace"):
        if not getattr(args, flag) > 0:
            raise UsageError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.port > 65535:
        raise UsageError(f"--port must be at most 65535, got {args.port}")
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("the API key is empty (--api-key or SPECEE_API_KEY): give a key, or unset it to serve "
                         "without one")
    if args.replicas is None and args.address is not None:
        raise UsageError("--address joins a Ray cluster and needs --replicas")
    if args.min_replicas > args.max_replicas:
        raise UsageError(f"--min-replicas {args.min_replicas} is above --max-replicas {args.max_replicas}")
    import ipaddress

    try:
        loopback = args.host == "localhost" or ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not args.api_key:
        print(f"specee: warning: serving on {args.host} without --api-key: anyone who can reach it may use it",
              file=sys.stderr)


def server_config(args, model_id: str = "specee"):
    """The server's settings from `specee serve`'s flags."""
    from .server.app import ServerConfig
    from .server.completions import Defaults

    return ServerConfig(
        model_id=model_id, defaults=Defaults(_sampling_kwargs(args), args.config),
        api_key=args.api_key, max_queue=args.max_queue, request_timeout=args.request_timeout,
        max_batch=args.max_batch, prefill_chunk=args.prefill_chunk, body_timeout=args.body_timeout,
        keep_alive=args.keep_alive_timeout, shutdown_grace=args.shutdown_grace,
    )


def serve_parser() -> argparse.ArgumentParser:
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subcommands.choices["serve"]


def serve_flags(options: dict) -> list[str]:
    """`specee serve` flags that give `options` (dests, as in a Ray Serve config's args), leaving
    out what equals the default; the inverse of parsing them."""
    actions = {a.dest: a for a in serve_parser()._actions if a.option_strings}
    unknown = sorted(set(options) - set(actions))
    if unknown:
        raise UsageError(f"not a specee serve option: {', '.join(unknown)}")
    flags: list[str] = []
    for dest, value in options.items():
        action = actions[dest]
        if value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            flags.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for item in value:
                flags += [flag, str(item)]
        else:
            flags += [flag, str(value)]
    return flags


def parse_serve_flags(flags: list[str]) -> argparse.Namespace:
    args = serve_parser().parse_args(flags)
    validate_serve_args(args)
    return args


def cluster_application(args):
    """The Ray Serve application `specee serve --replicas` runs (and a Ray Serve config builds:
    `specee.deploy`)."""
    from .cluster.app import ReplicaSpec, application

    from .model.cores import physical_cores

    threads = args.threads
    if threads is None:  # share this machine's cores among the replicas
        most = args.max_replicas if args.replicas == "auto" else args.replicas
        threads = max(1, physical_cores() // max(1, most))
    load = {"model": args.model, "dtype": args.dtype, "device": args.device, "threads": threads,
            "quantization": args.quantization, "compile": args.compile, "cpu_tier": args.cpu_tier,
            "ctx_size": args.ctx_size, "prefix_cache_mb": args.prefix_cache_mb}
    return application(ReplicaSpec(load, server_config(args), threads), args.replicas, args.min_replicas,
                       args.max_replicas, args.target_ongoing, args.routing)


def _serve_on_ray(args) -> int:
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise UsageError("--replicas serves through Ray Serve, which is not installed: pip install -e \".[cluster]\" "
                         "(or pip install \"ray[serve]\")")
    if args.model is not None and not Path(args.model).exists():
        raise UsageError(f"--model {args.model!r} does not exist")  # before Ray starts, not in each replica
    from .cluster.launch import run

    app = cluster_application(args)
    try:
        return run(app, args.host, args.port, args.address, args.replicas, args.shutdown_grace)
    except OSError as e:
        raise UsageError(str(e)) from None


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve, "bench": cmd_bench,
            "bench-serve": cmd_bench_serve, "train": cmd_train}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse itself exits with code 2 on malformed flags
    from .eval.datasets import DatasetMissing
    from .model.loading import ModelLoadError

    try:
        return COMMANDS[args.command](args)
    except (UsageError, ModelLoadError, DatasetMissing, ValueError) as e:
        print(f"specee: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("\nspecee: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
