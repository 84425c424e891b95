"""The `specee` command line: generate, chat, serve, bench, bench-serve, train, a module each with
its `add_parser(subcommands)` and `run(args)`; the model flags every command shares are `LoadOptions`
(specee/options.py), added by `loading.py`."""
from __future__ import annotations

import argparse
import sys

from . import bench, bench_serve, chat, generate, serve, train
from .common import EXIT_BAD_INPUT, UsageError

COMMANDS = {"generate": generate, "chat": chat, "serve": serve, "bench": bench, "bench-serve": bench_serve,
            "train": train}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specee", description="Fast LLM decoding on your machine.")
    subcommands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(subcommands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse itself exits with code 2 on malformed flags
    from ..eval.datasets import DatasetMissing
    from ..model.loading import ModelLoadError

    try:
        return COMMANDS[args.command].run(args)
    except (UsageError, ModelLoadError, DatasetMissing, ValueError) as e:
        print(f"specee: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("\nspecee: interrupted", file=sys.stderr)
        return 130


__all__ = ["EXIT_BAD_INPUT", "UsageError", "build_parser", "main"]
