"""Turn user options (CLI flags or API keywords, a SpecConfig) into a decoding strategy: dense, a
registered speculative method, or exits of a registered kind in either.

Tables, draft models and predictors come from the engine's ArtifactStore, loaded once and shared
read-only; the strategy builds a fresh proposer and policy for every generation, so requests never
share drafting state.

Exit candidates come from the free drafter (prompt lookup, else the model's trigram table: the one
named, or the one bundled for its tokenizer): a trained drafter would cost a pass of its own per
token, more than exits can save on this model.
"""
from __future__ import annotations

from dataclasses import replace

from ..artifact_store import ArtifactStore
from ..drafters.hybrid import Hybrid
from ..drafters.ngram import NgramProposer
from ..drafters.prompt_lookup import PromptLookup
from ..drafters.registry import SpecMethod, find_method
from ..exits.candidates import Candidates
from ..exits.registry import find_exit
from ..model.llama import Transformer
from ..verification.tree import StaticTree, parse_tree_paths, static_tree
from .base import Strategy
from .config import ExitConfig, SpecConfig
from .dense import Autoregressive
from .early_exit import EarlyExit
from .speculative import Speculative
from .speculative_exit import SpeculativeExit

# Where one more verified row costs at least COSTLY_ROW of a one-token pass (the model says, as
# `extra_row_cost`), drafts are smaller: shorter chains, tree nodes that must pay for their cost,
# smaller EAGLE trees. Each value beat the defaults tuned on near-flat passes on a tuning slice
# (BENCHMARKS.md, "Draft sizes for quantized weights"). Options the user gives win.
COSTLY_ROW = 0.1
QUANTIZED_CHAIN_LENGTH = 4
QUANTIZED_TREE_NODE_COST = 0.3
QUANTIZED_EAGLE_BUDGET = 3
# Where a row costs at least DEAR_ROW (the kernels' AVX2 tier: its int8 products go through pairs
# of 16-bit sums, not VNNI), shorter chains and dearer tree nodes won on an AVX2 tuning slice
# (BENCHMARKS.md, "CPU tiers"). The threshold lies halfway between the row prices measured on the
# AVX-512 tier (0.15) and the AVX2 tier (0.2), not on either: a model's price near one of them
# stays on its tier's side (tests/test_config.py pins the default model's sizes per tier and format).
DEAR_ROW = 0.175
DEAR_CHAIN_LENGTH = 2
DEAR_TREE_NODE_COST = 0.5


# Defaults where neither the user, the weight format nor a trained drafter's artifact sets a size.
DEFAULTS = dict(num_draft_tokens=8, tree_budget=4, tree_width=4, tree_min_prob=0.0, tree_node_cost=0.0,
                confidence_threshold=0.0)
ARTIFACT_SIZES = ("num_draft_tokens", "tree_budget", "tree_width", "tree_min_prob", "confidence_threshold")


def build_strategy(config: SpecConfig, artifacts: ArtifactStore) -> Strategy:
    """The strategy for a checked configuration: dense, speculative, or either under exits."""
    speculative = None if config.method == "none" else build_speculative(artifacts, config)
    if config.exit.kind != "none":
        return build_early_exit(artifacts, config.exit, speculative, config.ngram_model)
    return Autoregressive() if speculative is None else speculative


def resolve(config: SpecConfig, model: Transformer) -> SpecConfig:
    """`config` with its unset sizes filled: what the model's extra rows cost asks for, then the
    defaults. A trained drafter's sizes are its artifact's: its build reads them where still unset."""
    method = find_method(config.method)
    if method.sizes_itself:
        return config
    defaults = {k: v for k, v in DEFAULTS.items() if not (method.trained and k in ARTIFACT_SIZES)}
    filled = defaults | sized_for_weights(model, method, config)
    return replace(config, **{k: v for k, v in filled.items() if getattr(config, k) is None})


def sized_for_weights(model: Transformer, method: SpecMethod, config: SpecConfig) -> dict:
    """The draft-size defaults for what the model's extra rows cost."""
    if model.extra_row_cost < COSTLY_ROW:
        return {}
    if method.own_tree:
        return {"tree_budget": QUANTIZED_EAGLE_BUDGET}
    if method.trained:
        return {}  # its artifact's draft length
    dear = model.extra_row_cost >= DEAR_ROW
    if config.tree is None:
        return {"num_draft_tokens": DEAR_CHAIN_LENGTH if dear else QUANTIZED_CHAIN_LENGTH}
    if config.dynamic_tree:
        return {"tree_node_cost": DEAR_TREE_NODE_COST if dear else QUANTIZED_TREE_NODE_COST}
    return {}  # a static tree's size is the user's


def build_speculative(artifacts: ArtifactStore, config: SpecConfig) -> Speculative:
    """The registered method's proposers in the speculative loop, drafts shaped by the options
    (or by the drafter, where it settles them itself)."""
    config = resolve(config, artifacts.model)
    drafting = find_method(config.method).build(config, artifacts)
    tree: StaticTree | str | None = None
    if config.tree is not None:
        tree = "auto" if config.dynamic_tree else static_tree(parse_tree_paths(config.tree))
    name = config.method + ("" if tree is None else "-tree")
    # A trained drafter's shape is its own; what it leaves unset does not matter to it.
    budget, width = (drafting.tree_budget or config.tree_budget or DEFAULTS["tree_budget"],
                     drafting.tree_width or config.tree_width or DEFAULTS["tree_width"])
    return Speculative(drafting.make_proposer, drafting.num_draft_tokens or config.num_draft_tokens, tree,
                       budget, width, config.adaptive if drafting.adaptive is None else drafting.adaptive, name,
                       tree_min_prob=config.tree_min_prob or 0.0, node_cost=config.tree_node_cost,
                       shallow_layers=drafting.shallow_layers)


def build_early_exit(artifacts: ArtifactStore, config: ExitConfig, speculative: Speculative | None = None,
                     ngram_model: str | None = None) -> EarlyExit | SpeculativeExit:
    """Exits of the registered kind `config.kind` in plain decoding, or inside the verification
    passes of `speculative`; candidates from the table `ngram_model` (default: the bundled one)."""
    num_layers = artifacts.model.config.num_hidden_layers - 1  # layers with a decision (the last needs none)
    make_policy, k = find_exit(config.kind).build(config, artifacts, num_layers)
    kv = config.kv or "exact"
    name = f"exit-{config.kind}" + ("-approx" if kv == "approx" else "")
    candidates = exit_candidates(artifacts, k, ngram_model)
    if speculative is not None:
        return SpeculativeExit(speculative, candidates, make_policy, kv, name=f"{speculative.name}+{name}")
    return EarlyExit(candidates, make_policy, kv, name=name)


def exit_candidates(artifacts: ArtifactStore, k: int, ngram_model: str | None = None) -> Candidates:
    """Prompt lookup's and the trigram table's guesses, filled up with the table's most common tokens
    (decoding and `specee train exits` alike)."""
    table = artifacts.load("ngram", ngram_model)
    fallback = [token for token, _ in table.top_k([], k)]
    return Candidates(lambda: Hybrid(PromptLookup(), NgramProposer(table)), fallback, k)
