"""Early-exit kinds by name, each registered beside its policy (importing `specee.exits` registers
the built-in ones, `specee` and `rule`). The configuration's checks, the CLI, the server and the
builder read this table, so a new exit policy is its class and one `register_exit` call."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..registry import Registry


@dataclass(frozen=True)
class ExitKind:
    name: str
    # (ExitConfig, the engine's ArtifactStore, layers with a decision) -> (a maker of fresh policies,
    # one per generation; the drafter candidates each token's decision weighs). It loads and checks
    # what it needs now, so a bad file or setting fails before any generation.
    build: Callable[[Any, Any, int], tuple[Callable[[], Any], int]]
    options: tuple[str, ...] = ()  # ExitConfig fields only this kind reads; the other kinds refuse them


EXIT_KINDS = Registry("exit")
register_exit, find_exit = EXIT_KINDS.register, EXIT_KINDS.find
