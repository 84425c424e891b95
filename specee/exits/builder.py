"""Turn early-exit options (CLI flags or API keywords) into an early-exit strategy: exits in plain
decoding, or inside the verification passes of any speculative method (chains and trees).

Candidates come from the free drafter (prompt lookup, else the bundled trigram table): a trained
drafter would cost a pass of its own per token, more than exits can save on this model.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..artifact_store import ArtifactStore
from ..decoding.speculative import Speculative
from ..drafters.hybrid import Hybrid
from ..drafters.ngram import NgramProposer
from ..drafters.prompt_lookup import PromptLookup
from .autoregressive import EarlyExit
from .candidates import Candidates
from .policy import LearnedExit, RuleExit, RuleSettings
from .runner import KV_MODES
from .speculative import SpeculativeExit

EXIT_KINDS = ("specee", "rule")
RULE_CANDIDATES = 4


@dataclass
class ExitOptions:
    kind: str
    predictors: str | None = None  # a file from `specee train exits`; default: the bundled one
    threshold: float | None = None  # default: the artifact's
    kv: str = "exact"
    rule: str | None = None  # "P1,P2[,W]" for the rule

    def check(self) -> None:
        if self.kind not in EXIT_KINDS:
            raise ValueError(f"unknown exit {self.kind!r} (choose from none, {', '.join(EXIT_KINDS)})")
        if self.kv not in KV_MODES:
            raise ValueError(f"exit KV must be one of {', '.join(KV_MODES)}, got {self.kv!r}")
        if self.kind == "rule" and (self.predictors is not None or self.threshold is not None):
            raise ValueError("the exit rule has no predictors or threshold: set it with the rule option (P1,P2[,W])")
        if self.kind == "specee" and self.rule is not None:
            raise ValueError("the rule option applies to the rule exit, not specee")
        if self.threshold is not None and not 0 <= self.threshold:
            raise ValueError(f"exit threshold must be >= 0 (above 1: never exit), got {self.threshold}")

    def rule_settings(self) -> RuleSettings:
        if self.rule is None:
            return RuleSettings()
        try:
            values = [float(v) for v in str(self.rule).split(",")]
        except ValueError:
            values = []
        if len(values) not in (2, 3, 4) or (len(values) == 4 and not values[3].is_integer()):
            raise ValueError(f"exit rule {self.rule!r}: write P1,P2[,W[,L]] (e.g. 0.8,0.5; L: a layer number)")
        settings = RuleSettings(*values[:3], *(int(v) for v in values[3:]))
        settings.check()
        return settings


def build_early_exit(artifacts: ArtifactStore, options: dict, speculative: Speculative | None = None
                     ) -> EarlyExit | SpeculativeExit:
    """Exits in plain decoding, or inside the verification passes of `speculative`."""
    known = {f.name for f in fields(ExitOptions)}
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"unknown exit options {sorted('exit_' + k for k in unknown)}")
    opts = ExitOptions(**options)
    opts.check()
    model = artifacts.model
    num_layers = model.config.num_hidden_layers - 1  # layers with a decision (the last needs none)
    if opts.kind == "specee":
        artifact, predictors = artifacts.exit_predictors(opts.predictors)
        if predictors.num_layers != num_layers:
            raise ValueError(f"the exit predictors cover {predictors.num_layers} layers, the model has {num_layers + 1}")
        settings = artifact.settings
        threshold = settings.threshold if opts.threshold is None else opts.threshold
        candidates = settings.candidates

        def make_policy():
            return LearnedExit(predictors, settings, threshold)
    else:
        rule = opts.rule_settings()
        candidates = RULE_CANDIDATES

        def make_policy():
            return RuleExit(rule, num_layers)

        make_policy()  # a bad first layer fails here, not when a generation starts

    name = f"exit-{opts.kind}" + ("-approx" if opts.kv == "approx" else "")
    if speculative is not None:
        return SpeculativeExit(speculative, exit_candidates(artifacts, candidates), make_policy, opts.kv,
                               name=f"{speculative.name}+{name}")
    return EarlyExit(exit_candidates(artifacts, candidates), make_policy, opts.kv, name=name)


def exit_candidates(artifacts: ArtifactStore, k: int) -> Candidates:
    """Prompt lookup's and the bundled trigram table's guesses, filled up with the table's most
    common tokens (decoding and `specee train exits` alike)."""
    table = artifacts.ngram(None)
    fallback = [token for token, _ in table.top_k([], k)]
    return Candidates(lambda: Hybrid(PromptLookup(), NgramProposer(table)), fallback, k)
