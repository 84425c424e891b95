"""Turn user options (CLI flags or API keywords) into a speculative decoding strategy.

Tables and draft models come from the engine's ArtifactStore, loaded once and shared read-only;
the strategy builds a fresh proposer for every generation, so requests never share drafting state.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..artifact_store import ArtifactStore
from ..drafters.registry import METHODS, SpecMethod, find_method
from ..model.llama import Transformer
from ..verification.tree import StaticTree, parse_tree_paths, static_tree
from .speculative import Speculative


@dataclass
class SpecOptions:
    method: str  # a registered method (drafters/registry.py)
    num_draft_tokens: int = 8
    tree: str | None = None  # None: chain; "auto": dynamic tree; else rank paths "0;1;0,0"
    # On the 2-core CPU a pass over 5 inputs costs little more than one, over 9 about 1.2-1.4x;
    # 4 nodes matched or beat 3, 6 and 8 on the tuning slice (BENCHMARKS.md).
    tree_budget: int = 4
    tree_width: int | None = None  # dynamic trees: candidates per node (default 4)
    tree_min_prob: float = 0.0  # dynamic trees: stop growing below this path probability
    tree_node_cost: float = 0.0  # dynamic trees: one more node's cost, as a fraction of a pass
    adaptive: bool = True
    draft_model: str | None = None  # a model path, or "self:L" for the target's first L layers
    ngram_model: str | None = None
    # Chains: the last token drafted is the first whose drafter top probability is below this.
    confidence_threshold: float = 0.0
    # Hybrid chains: copy only after a match at least this long, else draft from the table (1 beat 2
    # and 3 on the tuning slice, BENCHMARKS.md).
    min_copy_match: int = 1
    drafter: str | None = None  # a trained drafter file (eagle, kangaroo); default: the bundled one
    # eagle-copy: draft prompt lookup's copy alone, skipping the head, when it is at least this
    # reliable (default: drafters.eagle.COPY_ALONE).
    copy_alone: float | None = None
    given: frozenset[str] = field(default=frozenset(), init=False, repr=False)  # the options the user set

    @classmethod
    def from_dict(cls, options: dict) -> "SpecOptions":
        known = {f.name for f in fields(cls) if f.init}
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"unknown speculative options {sorted(unknown)}")
        opts = cls(**options)
        opts.given = frozenset(options)
        return opts

    def check(self) -> None:
        method = find_method(self.method)
        if self.tree is not None and not self.tree.strip():
            raise ValueError('an empty tree: write --tree auto or rank paths like "0;1;0,0" (or leave it out for a chain)')
        if method.own_tree and self.tree is not None:
            raise ValueError(f"{self.method} drafts its own dynamic tree: leave the tree option out "
                             "(tree_budget, tree_width and tree_min_prob shape it)")
        for option in dict.fromkeys(o for m in METHODS.values() for o in m.options):
            if getattr(self, option, None) is not None and option not in method.options:
                *others, last = [name for name, m in METHODS.items() if option in m.options]
                names = f"{', '.join(others)} and {last} methods" if others else f"{last} method"
                raise ValueError(f"{option} applies to the {names}, not {self.method}")
        if self.copy_alone is not None and not 0 <= self.copy_alone <= 1:
            raise ValueError(f"copy_alone must be in [0, 1], got {self.copy_alone}")
        dynamic = method.own_tree or (self.tree is not None and self.tree.strip() == "auto")
        for name, value in (("tree_min_prob", self.tree_min_prob), ("confidence_threshold", self.confidence_threshold)):
            if not 0 <= value <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.min_copy_match < 1:
            raise ValueError(f"min_copy_match must be >= 1, got {self.min_copy_match}")
        if self.tree_node_cost < 0:
            raise ValueError(f"tree_node_cost must be >= 0, got {self.tree_node_cost}")
        if not dynamic:
            for name in ("tree_width", "tree_min_prob", "tree_node_cost"):
                if getattr(self, name):
                    raise ValueError(f"{name} applies to dynamic trees only (tree='auto')")
        if self.confidence_threshold:
            if self.tree is not None:
                raise ValueError("confidence_threshold applies to chains; trees stop growing at tree_min_prob")
            if not method.scored:
                raise ValueError(f"confidence_threshold needs a drafter with probabilities "
                                 f"({', '.join(name for name, m in METHODS.items() if m.scored)}), not {self.method}")


# Where one more verified row costs at least COSTLY_ROW of a one-token pass (the model says, as
# `extra_row_cost`), drafts are smaller: shorter chains, tree nodes that must pay for their cost,
# smaller EAGLE trees. Each value beat the defaults tuned on near-flat passes on a tuning slice
# (BENCHMARKS.md, "Draft sizes for quantized weights"). Options the user gives win.
COSTLY_ROW = 0.1
QUANTIZED_CHAIN_LENGTH = 4
QUANTIZED_TREE_NODE_COST = 0.3
QUANTIZED_EAGLE_BUDGET = 3


def sized_for_weights(model: Transformer, method: SpecMethod, options: dict) -> dict:
    """`options` with the draft-size defaults for what the model's extra rows cost filled in."""
    if model.extra_row_cost < COSTLY_ROW:
        return options
    tree = options.get("tree")
    if method.own_tree:
        defaults = {"tree_budget": QUANTIZED_EAGLE_BUDGET}
    elif method.trained:
        defaults = {}  # its artifact's draft length
    elif tree is None:
        defaults = {"num_draft_tokens": QUANTIZED_CHAIN_LENGTH}
    elif isinstance(tree, str) and tree.strip() == "auto":
        defaults = {"tree_node_cost": QUANTIZED_TREE_NODE_COST}
    else:
        defaults = {}  # a static tree's size is the user's
    return defaults | options


def build_speculative(artifacts: ArtifactStore, options: dict) -> Speculative:
    """The registered method's proposers in the speculative loop, drafts shaped by the options
    (or by the drafter, where it settles them itself)."""
    method = find_method(options.get("method"))
    opts = SpecOptions.from_dict(sized_for_weights(artifacts.model, method, options))
    opts.check()
    drafting = method.build(opts, artifacts)
    tree: StaticTree | str | None = None
    if opts.tree is not None:
        tree = "auto" if opts.tree.strip() == "auto" else static_tree(parse_tree_paths(opts.tree))
    name = opts.method + ("" if tree is None else "-tree")
    return Speculative(drafting.make_proposer, drafting.num_draft_tokens or opts.num_draft_tokens, tree,
                       drafting.tree_budget or opts.tree_budget, drafting.tree_width or opts.tree_width or 4,
                       opts.adaptive if drafting.adaptive is None else drafting.adaptive, name,
                       tree_min_prob=opts.tree_min_prob, node_cost=opts.tree_node_cost,
                       shallow_layers=drafting.shallow_layers)
