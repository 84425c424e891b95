"""Every speculative and early-exit option, declared once. A field's metadata (help, range, who may
set it) makes the CLI flags (`add_flags`), the server's request schema (`request_schema`) and the
engine's keywords (`SpecConfig.from_keywords`); `check` refuses what would be ignored, before any
model loads. None means "not set": `builder.resolve` fills it for the model and the method."""
from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Literal

MAX_DRAFT_NODES = 64  # verification writes this many cache slots past the output at most
# What runs when no method is named: `auto` (speculation that drafts only where it pays), or
# dense decoding under an early exit (exits inside verification are a choice, never a default).
DEFAULT_METHOD = "auto"


# What shapes a draft; a method that sizes its own (`auto`) takes none of them.
DRAFT_SHAPE = ("tree", "tree_budget", "tree_width", "tree_min_prob", "tree_node_cost", "confidence_threshold")


def default_method(exit_kind: str) -> str:
    return DEFAULT_METHOD if exit_kind == "none" else "none"


def option(default: Any = None, help: str = "", *, flag: str | None = "", keyword: str | None = None,
           http: bool = True, path: bool = False, choices: tuple | None = None, ge: float | None = None,
           le: float | None = None, max_length: int | None = None, http_pattern: str | None = None):
    """A configuration field. flag: its CLI flag ("" = from the keyword, None = none); keyword: its
    Python and HTTP name (default: the field's); http: a request may set it; path: a file on the
    server, never a request's (kept when a request picks its own method)."""
    return field(default=default, metadata=dict(help=help, flag=flag, keyword=keyword, http=http and not path,
                                                path=path, choices=choices, ge=ge, le=le, max_length=max_length,
                                                http_pattern=http_pattern))


@dataclass(frozen=True)
class ExitConfig:
    kind: str = option("none", "early exit (lossy): none, specee (trained per-layer predictors) or rule (the draft-"
                       "token rule, no training); with a --spec-method, inside the verification of its chains or "
                       "trees (greedy) (default none)", keyword="exit", max_length=40)
    predictors: str | None = option(help="predictors from `specee train exits` (default: the bundled ones)",
                                    keyword="exit_predictors", path=True)
    threshold: float | None = option(help="--exit specee: exit where a predictor's output is above this (default: "
                                          "the predictors' own; above 1 never exits)", keyword="exit_threshold", ge=0)
    kv: str | None = option(help="skipped layers' KV: exact (caught up in the next pass, default) or approx (from "
                                 "the exit state)", keyword="exit_kv", choices=("exact", "approx"))
    rule: str | None = option(help="--exit rule: P1,P2[,W[,L]]: exit when the top token's probability reaches P1 or "
                                   "the draft token's P2 (W: weight of the drafter's own probability; L: the first "
                                   "layer checked, default 7/8 of the depth) (default 0.99,0.9)",
                              keyword="exit_rule", max_length=40)

    def check(self, spell: Callable[[str], str]) -> None:
        from ..exits.registry import EXIT_KINDS, find_exit  # importing the exits registers the built-in kinds

        if self.kind == "none":
            given = [spell(keyword(f)) for f in fields(self) if f.name != "kind" and getattr(self, f.name) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} need " + " or ".join(f"{spell('exit')} {k}" for k in EXIT_KINDS))
            return
        reads = ("kind", "kv", *find_exit(self.kind, spell("exit")).options)
        unread = [spell(keyword(f)) for f in fields(self) if f.name not in reads and getattr(self, f.name) is not None]
        if unread:
            raise ValueError(f"{', '.join(unread)}: {spell('exit')} {self.kind} does not read them")


@dataclass(frozen=True)
class SpecConfig:
    # None: the default for the exit (default_method); help: the registered methods, read when flags are made.
    method: str | None = option(None, keyword="spec_method")
    num_draft_tokens: int | None = option(help="draft tokens per step (default 8, adapted; kangaroo: gamma, its "
                                               "artifact's)", ge=1, le=MAX_DRAFT_NODES)
    tree: str | None = option(help='verify a tree: "auto" (best-first under --tree-budget) or rank paths "0;1;0,0"',
                              max_length=400)
    # On the 2-core CPU a pass over 5 inputs costs little more than one; 4 nodes matched or beat 3, 6
    # and 8 on the tuning slice (BENCHMARKS.md).
    tree_budget: int | None = option(help="draft nodes per tree (default 4)", ge=1, le=MAX_DRAFT_NODES)
    draft_model: str | None = option(help="draft model path, or self:L for the target's first L layers (the draft "
                                          "and staged methods; auto consults it where the free drafters offer nothing)",
                                     http_pattern=r"^self:[0-9]{1,4}$")
    ngram_model: str | None = option(help="n-gram table from `specee train ngram` (default: the bundled one)",
                                     path=True)
    drafter: str | None = option(help="trained drafter from `specee train eagle` or `specee train kangaroo` "
                                      "(default: the bundled one)", path=True)
    copy_alone: float | None = option(help="eagle-copy: draft prompt lookup's copy alone (no head pass) when it is "
                                           "at least this reliable (default 0.7; 1 = always mix)", ge=0, le=1)
    tree_width: int | None = option(help="--tree auto and eagle: candidates per expanded node (default 4; eagle: "
                                          "its artifact's)", ge=1, le=MAX_DRAFT_NODES)
    confidence_threshold: float | None = option(
        help="chains (ngram, hybrid, draft, kangaroo): the last token drafted is the first whose drafter top "
             "probability is below this (kangaroo: eta, its artifact's)", flag="--draft-confidence", ge=0, le=1)
    tree_min_prob: float | None = option(help="--tree auto and eagle: stop growing where the best path's "
                                              "probability is below this (eagle: its artifact's, 0.5 for the "
                                              "bundled head)", ge=0, le=1)
    tree_node_cost: float | None = option(help="--tree auto: one more node's cost as a fraction of a one-token "
                                               "pass; growth stops when a node would lower the expected tokens per "
                                               "pass cost (default 0: budget only)", ge=0)
    # Hybrid chains: copy only after a match at least this long, else draft from the table (1 beat 2
    # and 3 on the tuning slice, BENCHMARKS.md).
    min_copy_match: int = option(1, flag=None, http=False, ge=1)
    adaptive: bool = option(True, flag=None, http=False)  # chains grow and shrink with acceptance
    exit: ExitConfig = field(default_factory=ExitConfig)

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", default_method(self.exit.kind))

    @classmethod
    def from_keywords(cls, keywords: dict) -> "SpecConfig":
        """The checked configuration for keywords as `Engine.stream` and HTTP requests spell them
        (spec_method, tree, ..., exit, exit_kv, ...); None values are "not set"."""
        config = unchecked(keywords)
        config.check()
        return config

    def keywords(self) -> dict:
        """The options set, by keyword (what `from_keywords` takes back); the method only where it is
        not the default, so options merged over these may still pick an exit's default."""
        chosen = {keyword(f): getattr(owner, f.name) for owner in (self, self.exit) for f in fields(owner)
                  if f.name != "exit" and getattr(owner, f.name) != f.default}
        if chosen["spec_method"] == default_method(self.exit.kind):
            del chosen["spec_method"]
        return chosen

    def merged(self, keywords: dict) -> "SpecConfig":
        """These options with `keywords` over them; keywords naming a method of their own keep only
        this configuration's files (its other options would not fit that method)."""
        base = self.keywords()
        if "spec_method" in keywords:
            paths = {keyword(f) for f in all_fields() if f.metadata["path"]}
            base = {k: v for k, v in base.items() if k in paths}
        return SpecConfig.from_keywords(base | keywords)

    @property
    def dynamic_tree(self) -> bool:
        return self.tree is not None and self.tree.strip() == "auto"

    @property
    def greedy_only(self) -> bool:
        """Exits inside speculative verification compare argmaxes."""
        return self.method != "none" and self.exit.kind != "none"

    def check(self, spell: Callable[[str], str] = lambda name: name) -> None:
        """Refuse values out of range and options the method or exit would not read. `spell` names
        an option as the user wrote it (the CLI passes its flags)."""
        from ..drafters.registry import METHODS, find_method  # registering imports every drafter

        for owner in (self, self.exit):
            for f in fields(owner):
                check_value(spell(keyword(f)), getattr(owner, f.name), f.metadata)
        self.exit.check(spell)
        if self.method == "none":  # files may be named for the methods a request picks
            unread = [spell(keyword(f)) for f in fields(self) if f.name not in ("exit", "method")
                      and not f.metadata["path"] and getattr(self, f.name) != f.default]
            if unread:
                raise ValueError(f"{', '.join(unread)}: no spec_method to read them")
            return
        method = find_method(self.method, spell("spec_method"))
        if method.sizes_itself:
            shapes = [spell(keyword(f)) for f in fields(self) if f.name in DRAFT_SHAPE and getattr(self, f.name) is not None]
            if shapes:
                raise ValueError(f"{', '.join(shapes)}: {self.method} sizes its own drafts (only "
                                 f"{spell('num_draft_tokens')} applies, as their longest); name a method to shape them")
        if self.tree is not None and not self.tree.strip():
            raise ValueError('an empty tree: write --tree auto or rank paths like "0;1;0,0" (or leave it out for a chain)')
        if method.own_tree and self.tree is not None:
            raise ValueError(f"{self.method} drafts its own dynamic tree: leave the tree option out "
                             "(tree_budget, tree_width and tree_min_prob shape it)")
        for name in dict.fromkeys(o for m in METHODS.values() for o in m.options):
            if getattr(self, name) is not None and name not in method.options:
                *others, last = [n for n, m in METHODS.items() if name in m.options]
                names = f"{', '.join(others)} and {last} methods" if others else f"{last} method"
                raise ValueError(f"{name} applies to the {names}, not {self.method}")
        if not (method.own_tree or self.dynamic_tree):
            for name in ("tree_width", "tree_min_prob", "tree_node_cost"):
                if getattr(self, name):
                    raise ValueError(f"{name} applies to dynamic trees only (tree='auto')")
        if self.confidence_threshold:
            if self.tree is not None:
                raise ValueError("confidence_threshold applies to chains; trees stop growing at tree_min_prob")
            if not method.scored:
                raise ValueError(f"confidence_threshold needs a drafter with probabilities "
                                 f"({', '.join(n for n, m in METHODS.items() if m.scored)}), not {self.method}")


def all_fields():
    return [f for owner in (SpecConfig, ExitConfig) for f in fields(owner) if f.name != "exit"]


def keyword(f) -> str:
    return f.metadata.get("keyword") or f.name


def flag(f) -> str | None:
    spelled = f.metadata.get("flag", "")
    return "--" + keyword(f).replace("_", "-") if spelled == "" else spelled


def check_value(name: str, value, metadata: dict) -> None:
    choices = metadata.get("choices")
    if value is not None and choices and value not in choices:
        raise ValueError(f"unknown {name} {value!r} (choose from {', '.join(choices)})")
    low, high = metadata.get("ge"), metadata.get("le")
    if value is None or (low is None or value >= low) and (high is None or value <= high):
        return
    bounds = f">= {low:g}" if high is None else f"in [{low:g}, {high:g}]"
    raise ValueError(f"{name} must be {bounds}, got {value}")


def value_type(f) -> type:
    """A field's type without its None: int, float, str or bool."""
    hint = typing.get_type_hints(SpecConfig if f in fields(SpecConfig) else ExitConfig)[f.name]
    return next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))


def add_flags(parser, methods: tuple[str, ...]) -> None:
    """Every option with a flag, on `parser` (dest: its keyword; default: unset)."""
    for f in all_fields():
        if flag(f) is None:
            continue
        help_text = f.metadata["help"] or (f"none (dense), {', '.join(methods)} (all lossless; default "
                                           f"{DEFAULT_METHOD}: drafts only where it pays; none with --exit)")
        default = f.default if f.default is not None and value_type(f) is str else None
        parser.add_argument(flag(f), dest=keyword(f), type=value_type(f), default=default, help=help_text)


def from_flags(args) -> SpecConfig:
    """The configuration the parsed flags give, checked, its errors naming the flags."""
    config = unchecked({keyword(f): getattr(args, keyword(f)) for f in all_fields() if flag(f) is not None})
    flags = {keyword(f): flag(f) for f in all_fields() if flag(f) is not None}
    config.check(lambda name: flags.get(name, name))
    return config


def unchecked(keywords: dict) -> SpecConfig:
    by_keyword = {keyword(f): f for f in all_fields()}
    unknown = set(keywords) - set(by_keyword)
    if unknown:
        raise ValueError(f"unknown options {sorted(unknown)}")
    spec = {by_keyword[k].name: v for k, v in keywords.items() if v is not None}
    exits = {name: spec.pop(name) for name in [f.name for f in fields(ExitConfig)] if name in spec}
    return SpecConfig(**spec, exit=ExitConfig(**exits))


def request_schema(base: type, registries: dict[str, Callable[[str], object]]) -> type:
    """The server's pydantic model of the options a request may set, with the same ranges; the names
    of `registries` ({keyword: find}) are looked up at each request, so late registrations count."""
    from pydantic import Field, create_model, field_validator

    specs = {}
    for f in all_fields():
        m = f.metadata
        if not m["http"]:
            continue
        kind = Literal[m["choices"]] if m["choices"] else value_type(f)
        specs[keyword(f)] = (kind | None, Field(None, ge=m["ge"], le=m["le"], max_length=m["max_length"],
                                                 pattern=m["http_pattern"]))

    def known(find: Callable[[str], object]):
        def check(cls, name):
            if name not in (None, "none"):
                find(name)
            return name
        return check

    validators = {f"known_{name}": field_validator(name)(known(find)) for name, find in registries.items()}
    return create_model("SpecOptions", __base__=base, __validators__=validators, **specs)
