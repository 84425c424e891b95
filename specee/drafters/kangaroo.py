"""Kangaroo self-drafting (Liu et al., 2024): the target's own first l layers, then a small trained
adapter (RMSNorm -> one attention block with its residual -> RMSNorm, no MLP), then the target's
final norm and output head over a reduced vocabulary (trained.py).

Double early exit:
- Drafting runs only layers [0, l) and the adapter. The shallow layers write the target's own
  cache as they go and their output states are the target's own, so verification runs only
  layers [l, L) on them (Draft.shallow): nothing below l is computed twice.
- Drafting stops after the first token whose top-1 probability is below eta, or after gamma
  tokens. The stop is decided from the distribution before its token is drawn, so sampling
  stays unbiased.

The adapter keeps its own one-layer cache. It is fed the shallow states of committed positions
only; when every draft token is accepted, the last one's state (run through the shallow layers
for verification, never through the adapter) is fed at the next step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..artifact_header import ArtifactKind, TrainedArtifact
from ..artifact_store import ArtifactLoader, register_artifact
from ..model.cache import KVCache
from ..model.config import LlamaConfig
from ..model.llama import Attention, RMSNorm, Transformer
from ..sampling import Sampler
from ..verification.draft import Draft
from .base import Proposer
from .registry import Drafting, SpecMethod, register
from .trained import drafter_cache, load_trained


class Adapter(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, 0)
        self.output_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, angles, cache: KVCache, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Shallow states [T, hidden] -> estimates of the target's last states [T, hidden]."""
        return self.output_layernorm(h + self.self_attn(self.input_layernorm(h), angles, cache, mask))


@dataclass
class KangarooSettings:
    """Chosen by measurement and stored in the artifact; eta and gamma are defaults a run may change."""

    layers: int = 2  # l: the target's first layers the drafter shares (fixed by training)
    eta: float = 0.6  # stop after the first draft token whose top-1 probability is below this
    gamma: int = 6  # most draft tokens per step


@dataclass
class KangarooArtifact(TrainedArtifact):
    """A trained adapter for one model (`weights`: the Adapter's state)."""

    HEADER: ClassVar[ArtifactKind] = ArtifactKind("specee-kangaroo", 1, "Kangaroo drafter", "specee train kangaroo")
    SETTINGS: ClassVar[type] = KangarooSettings


class KangarooModel:
    """The loaded adapter, ready to draft for one target: shared read-only by every request."""

    def __init__(self, target: Transformer, artifact: KangarooArtifact) -> None:
        total = target.config.num_hidden_layers
        if not 1 <= artifact.settings.layers < total:
            raise ValueError(f"a Kangaroo drafter on {artifact.settings.layers} shallow layers: the model has {total}")
        self.target, self.artifact, self.settings = target, artifact, artifact.settings
        self.adapter, self.vocab, self.scorer, self.adapter_bytes = load_trained(Adapter(target.config), artifact, target)
        self.shallow = range(artifact.settings.layers)
        self.shallow_bytes = target.layers_bytes(self.shallow)

    def logits(self, adapted: torch.Tensor) -> torch.Tensor:
        """[T, hidden] adapter outputs -> [T, N] logits over the reduced vocabulary."""
        return self.scorer(self.target.norm(adapted)).float()


class KangarooDrafter(Proposer):
    """Drafts a chain per step through the shared shallow layers and the adapter (module doc)."""

    def __init__(self, kangaroo: KangarooModel, eta: float, gamma: int) -> None:
        self.kangaroo = kangaroo
        self.eta, self.gamma = eta, gamma
        self.sampler: Sampler | None = None
        self.target_cache: KVCache | None = None
        self.adapter_cache: KVCache | None = None
        self.fed = 0  # the adapter's cache holds positions 0..fed-1
        self.pending: torch.Tensor | None = None  # shallow states of committed positions fed.. not yet fed
        self.last: tuple[int, torch.Tensor] | None = None  # (root position, shallow states) of the last draft

    def reset(self, prompt: list[int], sampler: Sampler | None) -> None:
        self.sampler = sampler
        self.adapter_cache = drafter_cache(self.kangaroo.target)
        self.fed = 0
        self.last = None

    def share_target(self, cache: KVCache, prompt_states: torch.Tensor) -> None:
        self.target_cache = cache
        self.pending = prompt_states

    def _shallow(self, token: int, position: int) -> torch.Tensor:
        """Run one token through the target's shallow layers, writing their cache: [1, hidden]."""
        target = self.kangaroo.target
        self.bytes_read += self.kangaroo.shallow_bytes
        return target.hidden(torch.tensor([token], device=target.device),
                             torch.tensor([position], device=target.device), self.target_cache,
                             layers=self.kangaroo.shallow)

    def _adapt(self, states: torch.Tensor) -> torch.Tensor:
        """Feed the adapter the states of positions fed.., return its last output's logits [N]."""
        target = self.kangaroo.target
        positions = torch.arange(self.fed, self.fed + states.shape[0], device=target.device)
        out = self.kangaroo.adapter(states, target.angles(positions), self.adapter_cache)
        self.fed += states.shape[0]
        self.bytes_read += self.kangaroo.adapter_bytes
        return self.kangaroo.logits(out[-1:])[0]

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        root = len(context) - 1
        if self.target_cache.length != root or self.fed + self.pending.shape[0] != root:
            raise RuntimeError("Kangaroo drafter: the caches are out of step with the context")
        greedy = self.sampler is None or self.sampler.greedy
        vocab = self.kangaroo.vocab
        tokens: list[int] = []
        dists: list[torch.Tensor] = []
        states: list[torch.Tensor] = []
        token, confident = context[-1], True
        while True:
            states.append(self._shallow(token, root + len(tokens)))
            if len(tokens) >= min(self.gamma, max_tokens) or not confident:
                break
            logits = self._adapt(torch.cat((self.pending, states[-1])))
            self.pending = states[-1][:0]
            if greedy:
                probs = logits.softmax(-1)
                best = int(probs.argmax())
                token, top = int(vocab[best]), float(probs[best])
            else:  # drawn from the processed distribution over the full vocabulary (q for verification)
                full = logits.new_full((self.kangaroo.target.config.vocab_size,), float("-inf"))
                full[vocab] = logits
                probs = self.sampler.probs(full[None])[0]
                token = int(torch.multinomial(probs, 1, generator=self.sampler.generator))
                top = float(probs.max())
                dists.append(probs)
            tokens.append(token)
            confident = top >= self.eta
        shallow = torch.cat(states)
        self.last = (root, shallow)
        if greedy:
            return Draft.chain(tokens, shallow=shallow)
        return Draft.chain(tokens, q=torch.stack(dists), sampled=True, shallow=shallow)

    def update(self, context: list[int], num_accepted: int) -> None:
        """Keep the adapter's cache to committed positions; a fully accepted draft leaves its last
        token's shallow state to feed next time (the target's cache is trimmed by the strategy)."""
        root, shallow = self.last
        committed = root + num_accepted + 1  # root and accepted tokens; the target's own next token is not run yet
        self.fed = min(self.fed, committed)
        self.adapter_cache.truncate(self.fed)
        self.pending = shallow[self.fed - root:committed - root]


def _kangaroo_method(config, artifacts) -> Drafting:
    """Chains through the shared shallow layers; eta and gamma from the artifact unless given."""
    if config.tree is not None:
        raise ValueError("kangaroo drafts chains: leave the tree option out")
    kangaroo = artifacts.load("kangaroo", config.drafter)
    settings = kangaroo.settings
    gamma = config.num_draft_tokens or settings.gamma
    eta = settings.eta if config.confidence_threshold is None else config.confidence_threshold
    return Drafting(lambda: KangarooDrafter(kangaroo, eta, gamma), gamma, adaptive=False,
                    shallow_layers=settings.layers)


register_artifact(ArtifactLoader(
    "kangaroo", lambda path, store: KangarooModel(store.model, KangarooArtifact.load(path, store.model)),
    "the kangaroo method needs --drafter FILE"))
register(SpecMethod("kangaroo", _kangaroo_method, scored=True, options=("drafter",), bench={"kangaroo": {}}))
