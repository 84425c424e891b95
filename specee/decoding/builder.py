"""Turn user options (CLI flags or API keywords) into a speculative decoding strategy.

Tables and draft models are loaded once per target (`Artifacts`) and shared read-only; the
strategy builds a fresh proposer for every generation, so requests never share drafting state.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..drafters.eagle import BUNDLED as BUNDLED_EAGLE
from ..drafters.eagle import EagleArtifact, EagleModel
from ..drafters.kangaroo import BUNDLED as BUNDLED_KANGAROO
from ..drafters.kangaroo import KangarooArtifact, KangarooModel
from ..drafters.ngram import NgramModel
from ..drafters.registry import SpecMethod, find_method
from ..loader import dtype_name, load_parts
from ..model.llama import Transformer
from ..tokenizer import Tokenizer
from ..verification.tree import StaticTree, parse_tree_paths, static_tree
from .config import SpecConfig
from .speculative import Speculative

BUNDLED_NGRAM = Path(__file__).resolve().parent.parent / "artifacts" / "smollm2-135m-instruct.trigram.pt"


class Artifacts:
    """What strategies load for one target: n-gram tables and draft models, each loaded once and
    shared read-only by every request."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self._tables: dict[str, NgramModel] = {}
        self._drafts: dict[str, Transformer] = {}
        self._trained: dict[tuple[str, str], object] = {}

    def ngram(self, path: str | None) -> NgramModel:
        path = given_or_bundled(path, BUNDLED_NGRAM, "the ngram method needs --ngram-model FILE (train one with "
                                                      "`specee train ngram`)")
        key = str(path)
        if key not in self._tables:
            if not Path(path).exists():
                raise ValueError(f"n-gram model {key!r} does not exist")
            self._tables[key] = NgramModel.load(path, self.tokenizer.fingerprint)
        return self._tables[key]

    def draft_model(self, spec: str | None) -> tuple[Transformer, int | None]:
        """(draft weights, layers to use: None for all) for a path or "self:L"."""
        if spec is None:
            raise ValueError("the draft and staged methods need --draft-model PATH or --draft-model self:L")
        if spec.startswith("self:"):
            try:
                return self.model, int(spec.removeprefix("self:"))
            except ValueError:
                raise ValueError(f"--draft-model {spec!r}: write self:L with L a number of layers") from None
        if spec not in self._drafts:
            parts = load_parts(spec, dtype=dtype_name(self.model.dtype), device=self.model.device.type)
            if parts.tokenizer.vocab != self.tokenizer.vocab:
                raise ValueError(f"draft model {spec!r} does not share the target's tokenizer")
            self._drafts[spec] = parts.model
        return self._drafts[spec], None

    def eagle(self, path: str | None) -> EagleModel:
        return self._trained_drafter("eagle", path, BUNDLED_EAGLE, EagleArtifact, EagleModel)

    def kangaroo(self, path: str | None) -> KangarooModel:
        return self._trained_drafter("kangaroo", path, BUNDLED_KANGAROO, KangarooArtifact, KangarooModel)

    def _trained_drafter(self, kind: str, path: str | None, bundled: Path, artifact, loaded):
        path = given_or_bundled(path, bundled, f"the {kind} method needs --drafter FILE (train one with "
                                                f"`specee train {kind}`)")
        return self.trained(kind, path, lambda p: loaded(self.model, artifact.load(p, self.model)))

    def trained(self, kind: str, path, load):
        """What `load(path)` gives, loaded once per (kind, path)."""
        key = (kind, str(path))
        if key not in self._trained:
            self._trained[key] = load(path)
        return self._trained[key]


def given_or_bundled(path: str | None, bundled: Path, missing: str) -> str | Path:
    """The file the user named, else the one shipped with specee (an error when it is absent)."""
    if path is not None:
        return path
    if not bundled.exists():
        raise ValueError(missing)
    return bundled


# Where one more verified row costs at least COSTLY_ROW of a one-token pass (the model says, as
# `extra_row_cost`), drafts are smaller: shorter chains, tree nodes that must pay for their cost,
# smaller EAGLE trees. Each value beat the defaults tuned on near-flat passes on a tuning slice
# (BENCHMARKS.md, "Draft sizes for quantized weights"). Options the user gives win.
COSTLY_ROW = 0.1
QUANTIZED_CHAIN_LENGTH = 4
QUANTIZED_TREE_NODE_COST = 0.3
QUANTIZED_EAGLE_BUDGET = 3


# Defaults where neither the user, the weight format nor a trained drafter's artifact sets a size.
DEFAULTS = dict(num_draft_tokens=8, tree_budget=4, tree_width=4, tree_min_prob=0.0, tree_node_cost=0.0,
                confidence_threshold=0.0)
ARTIFACT_SIZES = ("num_draft_tokens", "tree_budget", "tree_width", "tree_min_prob", "confidence_threshold")


def resolve(config: SpecConfig, model: Transformer) -> SpecConfig:
    """`config` with its unset sizes filled: what the model's extra rows cost asks for, then the
    defaults. A trained drafter's sizes are its artifact's: its build reads them where still unset."""
    method = find_method(config.method)
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
    if config.tree is None:
        return {"num_draft_tokens": QUANTIZED_CHAIN_LENGTH}
    if config.dynamic_tree:
        return {"tree_node_cost": QUANTIZED_TREE_NODE_COST}
    return {}  # a static tree's size is the user's


def build_speculative(artifacts: Artifacts, config: SpecConfig) -> Speculative:
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
