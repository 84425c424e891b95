"""One registry of decoding strategies: the CLI, the API and the benchmark all look here, so a
new mode needs no code anywhere else."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from .autoregressive import Autoregressive
from .base import Strategy

if TYPE_CHECKING:
    from ..engine import Engine


@dataclass(frozen=True)
class StrategySpec:
    name: str
    lossless: bool
    build: Callable[["Engine", dict], Strategy]  # (engine, options) -> a ready strategy
    description: str
    bench_options: dict = field(default_factory=dict)  # the options `specee bench` runs it with
    # False for modes that need something the user must supply (a draft model, a trained table).
    in_default_bench: bool = True


REGISTRY: dict[str, StrategySpec] = {}


def register(spec: StrategySpec) -> StrategySpec:
    REGISTRY[spec.name] = spec
    return spec


def build_strategy(name: str, engine: "Engine", options: dict | None = None) -> Strategy:
    if name not in REGISTRY:
        raise ValueError(f"unknown decoding method {name!r} (choose from {', '.join(REGISTRY)})")
    return REGISTRY[name].build(engine, options or {})


register(StrategySpec("dense", True, lambda engine, options: Autoregressive(), "one target pass per token"))
