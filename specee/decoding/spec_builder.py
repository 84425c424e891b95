"""Turn user options (CLI flags or API keywords) into a speculative decoding strategy."""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from ..drafters.draft_model import DraftModel, StagedDraft
from ..drafters.hybrid import Hybrid
from ..drafters.ngram import NgramModel, NgramProposer
from ..drafters.prompt_lookup import PromptLookup
from ..tree import parse_tree_paths, static_tree
from .speculative import Speculative

if TYPE_CHECKING:
    from ..engine import Engine

METHODS = ("prompt-lookup", "ngram", "hybrid", "draft", "staged")
BUNDLED_NGRAM = Path(__file__).resolve().parent.parent / "artifacts" / "smollm2-135m-instruct.trigram.pt"


@dataclass
class SpecOptions:
    method: str
    num_draft_tokens: int = 8
    tree: str | None = None  # None: chain; "auto": dynamic tree; else rank paths "0;1;0,0"
    # On the 2-core CPU a pass over 5 inputs costs little more than one, over 9 about 1.2-1.4x:
    # 4-node trees beat 8 and 16 on summaries and code (BENCHMARKS.md).
    tree_budget: int = 4
    tree_width: int = 4
    adaptive: bool = True
    draft_model: str | None = None  # a model path, or "self:L" for the target's first L layers
    ngram_model: str | None = None
    confidence_threshold: float = 0.0  # stop drafting when the drafter's probability falls below
    tree_node_cost: float = 0.0  # dynamic trees: one more node's cost, as a fraction of a pass

    @classmethod
    def from_dict(cls, options: dict) -> "SpecOptions":
        known = {f.name for f in fields(cls)}
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"unknown speculative options {sorted(unknown)}")
        return cls(**options)


def build_speculative(engine: "Engine", options: dict) -> Speculative:
    opts = SpecOptions.from_dict(options)
    if opts.method not in METHODS:
        raise ValueError(f"unknown speculative method {opts.method!r} (choose from none, {', '.join(METHODS)})")
    proposer = {
        "prompt-lookup": lambda: PromptLookup(num_draft_tokens=opts.num_draft_tokens),
        "ngram": lambda: NgramProposer(load_ngram(engine, opts.ngram_model), opts.num_draft_tokens,
                                       min_prob=opts.confidence_threshold),
        "hybrid": lambda: Hybrid(PromptLookup(num_draft_tokens=opts.num_draft_tokens),
                                 NgramProposer(load_ngram(engine, opts.ngram_model), opts.num_draft_tokens,
                                               min_prob=opts.confidence_threshold)),
        "draft": lambda: load_draft_model(engine, opts),
        "staged": lambda: StagedDraft(load_draft_model(engine, opts), _stage_two(engine, opts)),
    }[opts.method]()
    tree = None
    if opts.tree == "auto":
        tree = "auto"
    elif opts.tree:
        tree = static_tree(parse_tree_paths(opts.tree))
    name = opts.method + ("" if tree is None else "-tree")
    if opts.tree_node_cost < 0:
        raise ValueError(f"tree_node_cost must be >= 0, got {opts.tree_node_cost}")
    return Speculative(proposer, opts.num_draft_tokens, tree, opts.tree_budget, opts.tree_width, opts.adaptive, name,
                       min_prob=opts.confidence_threshold, node_cost=opts.tree_node_cost)


def _stage_two(engine: "Engine", opts: SpecOptions):
    """The cheap proposer inside staged drafting: the n-gram table when given, else prompt lookup."""
    if opts.ngram_model:
        return NgramProposer(load_ngram(engine, opts.ngram_model))
    return PromptLookup()


def load_ngram(engine: "Engine", path: str | None) -> NgramModel:
    if path is None:
        if not BUNDLED_NGRAM.exists():
            raise ValueError("the ngram method needs --ngram-model FILE (train one with `specee train ngram`)")
        path = BUNDLED_NGRAM
    if not Path(path).exists():
        raise ValueError(f"n-gram model {str(path)!r} does not exist")
    return NgramModel.load(path, engine.fingerprint)


def load_draft_model(engine: "Engine", opts: SpecOptions) -> DraftModel:
    spec = opts.draft_model
    if spec is None:
        raise ValueError("the draft and staged methods need --draft-model PATH or --draft-model self:L")
    if spec.startswith("self:"):
        try:
            layers = int(spec.removeprefix("self:"))
        except ValueError:
            raise ValueError(f"--draft-model {spec!r}: write self:L with L a number of layers") from None
        return DraftModel(engine.model, layers, opts.confidence_threshold)
    from ..loader import load_engine

    draft = load_engine(spec, dtype=_dtype_name(engine), device=engine.model.device.type)
    if draft.tokenizer.vocab != engine.tokenizer.vocab:
        raise ValueError(f"draft model {spec!r} does not share the target's tokenizer")
    return DraftModel(draft.model, confidence_threshold=opts.confidence_threshold)


def _dtype_name(engine: "Engine") -> str:
    from ..engine import DTYPES

    return next(name for name, dtype in DTYPES.items() if dtype == engine.model.dtype)
