"""The flags of what an answer is drawn by: sampling, stops and the decoding configuration
(`SpecConfig`'s flags), checked before the model loads."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from ..options import add_flags, non_negative_int, option
from .common import UsageError
from .loading import validate_model_options


@dataclass(frozen=True)
class SamplingOptions:
    """`Engine.stream`'s keywords of the same names; `specee serve`: the defaults of requests."""

    max_tokens: int = option(256, "most tokens to generate (default 256)", parse=int)
    temperature: float = option(0.0, "0 = greedy (default)", parse=float)
    top_k: int = option(0, "sample among the k most likely tokens (0 = off)", parse=non_negative_int)
    top_p: float = option(1.0, "nucleus sampling mass in (0, 1]", parse=float)
    seed: int | None = option(help="random seed for sampling", parse=int)
    presence_penalty: float = option(
        0.0, "subtract this from the logit of every token already generated, in -2..2 (default 0)", parse=float)
    frequency_penalty: float = option(
        0.0, "subtract this times its count so far from each generated token's logit, in -2..2 (default 0)",
        parse=float)
    stop: tuple[str, ...] = option((), "stop string (repeatable)", action="append")
    ignore_eos: bool = option(False, "keep going past end-of-sequence (benchmarks)", action="store_true")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    from ..strategies.config import add_flags as add_decoding_flags
    from ..drafters.registry import (
        METHODS,  # importing the drafters registers the built-in methods
    )

    add_flags(p, SamplingOptions)
    add_decoding_flags(p, tuple(METHODS))


def sampling_kwargs(args) -> dict:
    return {f.name: getattr(args, f.name) for f in fields(SamplingOptions)}


def validate_sampling(args) -> None:
    """Checked before the model loads, so bad flags fail in milliseconds; sets args.config, the
    decoding configuration."""
    from ..strategies.config import from_flags
    from ..sampling import SamplingParams

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
    validate_model_options(args)
