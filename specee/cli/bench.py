"""`specee bench`: speed and quality of every mode, side by side with baselines."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

from ..options import non_negative_int, positive_int
from . import loading
from .common import UsageError, writable
from .loading import add_model_options, validate_model_options


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="speed and quality of every mode, side by side with baselines")
    add_model_options(bench)
    bench.add_argument("--suite", default="quick", help="quick (a few minutes) or full (every category and dataset, about an hour on 2 cores; default quick)")
    bench.add_argument("--dataset", action="append", help="spec-bench, humaneval, mtbench, gsm8k, mmlu or a "
                       "Spec-Bench-format .jsonl file (repeatable; default: the suite's)")
    bench.add_argument("--num-prompts", type=positive_int, help="prompts per category")
    bench.add_argument("--categories", help="comma-separated categories to keep")
    bench.add_argument("--max-tokens", type=positive_int, help="tokens generated per prompt")
    bench.add_argument("--modes", help="comma-separated modes (default: all registered modes and baselines); a "
                       "registered mode takes speculative options as name[key=value,...], e.g. hybrid-tree[tree_budget=6]")
    bench.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--ignore-eos", action="store_true",
                       help="fixed-length runs: generate --max-tokens past EOS (default: stop at EOS, as a user would)")
    bench.add_argument("--skip-first", type=non_negative_int, default=0,
                       help="leave out each category's first N prompts: tune on --skip-first 5 --num-prompts 5, "
                            "report on the first prompts (default 0)")
    bench.add_argument("--repeats", type=positive_int, default=1,
                       help="run every mode N times on each prompt, in rotated rounds, and count its fastest run "
                            "(other work on the machine only slows a run down) (default 1)")
    bench.add_argument("--out", default="bench-out", help="output folder (default bench-out)")


def run(args) -> int:
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError('specee bench draws plots with matplotlib: pip install "specee[bench]"')
    from ..eval.bench import BenchConfig, run_bench

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
    writable(Path(args.out), "--out", folder=True)
    validate_model_options(args)
    run_bench(loading.load(args), config, explicit_datasets=bool(args.dataset))
    return 0
