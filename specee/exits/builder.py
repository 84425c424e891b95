"""Turn early-exit options (CLI flags or API keywords) into an early-exit strategy: exits in plain
decoding, or inside the verification passes of any speculative method (chains and trees).

Candidates come from the free drafter (prompt lookup, else the bundled trigram table): a trained
drafter would cost a pass of its own per token, more than exits can save on this model.
"""
from __future__ import annotations

from functools import partial

from ..artifact_store import ArtifactStore
from ..decoding.config import ExitConfig
from ..decoding.speculative import Speculative
from ..drafters.hybrid import Hybrid
from ..drafters.ngram import NgramProposer
from ..drafters.prompt_lookup import PromptLookup
from .autoregressive import EarlyExit
from .candidates import Candidates
from .policy import LearnedExit, RuleExit, RuleSettings
from .speculative import SpeculativeExit

RULE_CANDIDATES = 4


def rule_settings(rule: str | None) -> RuleSettings:
    if rule is None:
        return RuleSettings()
    try:
        values = [float(v) for v in str(rule).split(",")]
    except ValueError:
        values = []
    if len(values) not in (2, 3, 4) or (len(values) == 4 and not values[3].is_integer()):
        raise ValueError(f"exit rule {rule!r}: write P1,P2[,W[,L]] (e.g. 0.8,0.5; L: a layer number)")
    settings = RuleSettings(*values[:3], *(int(v) for v in values[3:]))
    settings.check()
    return settings


def build_early_exit(artifacts: ArtifactStore, config: ExitConfig, speculative: Speculative | None = None
                     ) -> EarlyExit | SpeculativeExit:
    """Exits in plain decoding, or inside the verification passes of `speculative`."""
    model = artifacts.model
    num_layers = model.config.num_hidden_layers - 1  # layers with a decision (the last needs none)
    kv = config.kv or "exact"
    if config.kind == "specee":
        artifact, predictors = artifacts.exit_predictors(config.predictors)
        if predictors.num_layers != num_layers:
            raise ValueError(f"the exit predictors cover {predictors.num_layers} layers, the model has {num_layers + 1}")
        settings = artifact.settings
        threshold = settings.threshold if config.threshold is None else config.threshold
        k = settings.candidates
        make_policy = partial(LearnedExit, predictors, settings, threshold)  # a fresh one per generation
    else:
        k = RULE_CANDIDATES
        make_policy = partial(RuleExit, rule_settings(config.rule), num_layers)
        make_policy()  # a bad first layer fails here, not when a generation starts
    name = f"exit-{config.kind}" + ("-approx" if kv == "approx" else "")
    candidates = exit_candidates(artifacts, k)
    if speculative is not None:
        return SpeculativeExit(speculative, candidates, make_policy, kv, name=f"{speculative.name}+{name}")
    return EarlyExit(candidates, make_policy, kv, name=name)


def exit_candidates(artifacts: ArtifactStore, k: int) -> Candidates:
    """Prompt lookup's and the bundled trigram table's guesses, filled up with the table's most
    common tokens (decoding and `specee train exits` alike)."""
    table = artifacts.ngram(None)
    fallback = [token for token, _ in table.top_k([], k)]
    return Candidates(lambda: Hybrid(PromptLookup(), NgramProposer(table)), fallback, k)
