"""Named decoding modes (a strategy with fixed options each). `specee bench` runs every one, so a
new mode needs no benchmark code. A mode is built from the engine it runs on (anything with a
`strategy(method, **options)` method); this module imports no engine."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .autoregressive import Autoregressive
from .base import Strategy


@dataclass(frozen=True)
class StrategySpec:
    name: str
    lossless: bool
    build: Callable[[Any, dict], Strategy]  # (engine, options) -> a ready strategy
    description: str


REGISTRY: dict[str, StrategySpec] = {}


def register(spec: StrategySpec) -> StrategySpec:
    REGISTRY[spec.name] = spec
    return spec


def _speculative(method: str, **defaults):
    def build(engine, options: dict) -> Strategy:
        return engine.strategy(method, **(defaults | options))

    return build


register(StrategySpec("dense", True, lambda engine, options: Autoregressive(), "one target pass per token"))
register(StrategySpec("prompt-lookup", True, _speculative("prompt-lookup"), "chain copied from earlier text"))
register(StrategySpec("prompt-lookup-tree", True, _speculative("prompt-lookup", tree="auto"),
                      "tree of the continuations of every earlier match"))
register(StrategySpec("ngram", True, _speculative("ngram"), "chain from the bundled trigram table"))
register(StrategySpec("ngram-tree", True, _speculative("ngram", tree="auto"), "best-first trigram tree"))
register(StrategySpec("hybrid", True, _speculative("hybrid"), "prompt lookup, else the trigram table"))
register(StrategySpec("hybrid-tree", True, _speculative("hybrid", tree="auto"), "best-first tree of both"))
register(StrategySpec("draft-self", True, _speculative("draft", draft_model="self:6"),
                      "the target's first 6 layers as draft model"))
register(StrategySpec("staged", True, _speculative("staged", draft_model="self:6"),
                      "self:6 draft model, itself sped up by prompt lookup"))
register(StrategySpec("eagle", True, _speculative("eagle"),
                      "trained EAGLE-style feature head (bundled), dynamic tree over a reduced vocabulary"))
register(StrategySpec("eagle-copy", True, _speculative("eagle-copy"),
                      "the EAGLE tree with prompt lookup's copy mixed in; the copy alone where it is reliable"))
register(StrategySpec("kangaroo", True, _speculative("kangaroo"),
                      "trained Kangaroo adapter (bundled) on the target's shared shallow layers, chains"))


def _exit(kind: str, spec_method: str | None = None, **defaults):
    def build(engine, options: dict) -> Strategy:
        return engine.strategy(spec_method, exit=kind, **(defaults | options))

    return build


register(StrategySpec("exit-specee", False, _exit("specee"),
                      "early exit by the bundled per-layer predictors on prompt-lookup/trigram candidates, exact KV"))
register(StrategySpec("exit-specee-approx", False, _exit("specee", exit_kv="approx"),
                      "exit-specee with the skipped layers' KV computed from the exit state"))
register(StrategySpec("exit-rule", False, _exit("rule"),
                      "early exit by the draft-token rule (top token >= 0.99 or draft token >= 0.9, from 7/8 of the "
                      "depth), exact KV"))
register(StrategySpec("hybrid+exit-specee", False, _exit("specee", spec_method="hybrid"),
                      "hybrid chains whose verification passes exit early (bundled predictors, exact KV)"))
register(StrategySpec("hybrid+exit-rule", False, _exit("rule", spec_method="hybrid"),
                      "hybrid chains whose verification passes exit by the draft-token rule, exact KV"))
register(StrategySpec("hybrid-tree+exit-specee", False, _exit("specee", spec_method="hybrid", tree="auto"),
                      "hybrid trees whose verification passes exit early (hyper-tokens), exact KV"))
register(StrategySpec("eagle-copy+exit-specee", False, _exit("specee", spec_method="eagle-copy"),
                      "eagle-copy trees whose verification passes exit early (hyper-tokens), exact KV"))
register(StrategySpec("kangaroo+exit-specee", False, _exit("specee", spec_method="kangaroo"),
                      "Kangaroo chains whose verification (above the shared layers) exits early, exact KV"))
