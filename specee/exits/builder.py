"""Turn early-exit options (CLI flags or API keywords) into an early-exit strategy: exits in plain
decoding, or inside the verification passes of any speculative method (chains and trees).

Candidates come from the free drafter (prompt lookup, else the model's trigram table: the one named,
or the one bundled for its tokenizer): a trained
drafter would cost a pass of its own per token, more than exits can save on this model.
"""
from __future__ import annotations

from ..artifact_store import ArtifactStore
from ..decoding.config import ExitConfig
from ..decoding.speculative import Speculative
from ..drafters.hybrid import Hybrid
from ..drafters.ngram import NgramProposer
from ..drafters.prompt_lookup import PromptLookup
from .autoregressive import EarlyExit
from .candidates import Candidates
from .registry import find_exit
from .speculative import SpeculativeExit


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
