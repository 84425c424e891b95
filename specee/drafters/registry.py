"""Speculative methods by name, each registered by its drafter's module (importing `specee.drafters`
registers the built-in ones). The builder, the CLI, the server and the bench read this table, so a
new drafter is one module that calls `register` (and `register_artifact`, if it loads a file)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..registry import Registry
from .base import Proposer


@dataclass(frozen=True)
class Drafting:
    """What a method's build gives the speculative loop: a maker of fresh proposers (one per
    generation) and, where the drafter settles the draft's shape itself (trained drafters read it
    from their file), that shape; None leaves it to the user's options."""

    make_proposer: Callable[[], Proposer]
    num_draft_tokens: int | None = None
    tree_budget: int | None = None
    tree_width: int | None = None
    adaptive: bool | None = None
    shallow_layers: int | None = None  # the target's first layers the drafter runs itself


@dataclass(frozen=True)
class SpecMethod:
    name: str
    # (config, artifacts) -> Drafting. `config`: the checked, resolved SpecConfig (a trained
    # drafter's sizes unset unless the user set them); `artifacts`: the engine's ArtifactStore
    # (.model, .tokenizer; `load(kind, path)` gives an artifact whose module registered its loader,
    # loaded once). It loads what it needs now, so a bad path fails before any generation.
    build: Callable[[Any, Any], Drafting]
    scored: bool = False  # a probability per drafted token, which confidence_threshold reads
    own_tree: bool = False  # drafts its own dynamic tree: the tree option does not apply
    sizes_itself: bool = False  # sizes every draft itself (`auto`): no default draft sizes apply
    options: tuple[str, ...] = ()  # options only some methods read; any other method refuses them
    bench: dict[str, dict] = field(default_factory=dict)  # `specee bench` modes: name -> options

    @property
    def trained(self) -> bool:
        """Reads a drafter file from `specee train` (its artifact holds its draft sizes)."""
        return "drafter" in self.options


METHODS = Registry("speculative method")
register, find_method = METHODS.register, METHODS.find
