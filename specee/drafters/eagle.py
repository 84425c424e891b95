"""EAGLE-style feature head (Li et al., EAGLE and EAGLE-2): a one-layer drafter that reads the
target's own last hidden states.

At position i the head takes [embedding of token i ; the target's last hidden state at i - 1],
maps it to the hidden size with one linear layer, runs one decoder layer (its own KV cache) and
returns an estimate of the target's hidden state at i; the target's final norm and output head
turn that into the draft distribution of token i + 1. Drafting feeds the head its own estimates,
so it runs ahead of the target. The target's hidden states come for free from the verification
pass the strategy already runs.

The head scores a reduced vocabulary (trained.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..artifact_header import ArtifactKind, TrainedArtifact
from ..artifact_store import ArtifactLoader, register_artifact
from ..model.cache import KVCache
from ..model.config import LlamaConfig
from ..model.llama import DecoderLayer, Transformer
from ..sampling import Sampler
from ..verification.draft import Draft
from .base import Proposer
from .prompt_lookup import PromptLookup
from .registry import Drafting, SpecMethod, register
from .trained import drafter_cache, load_trained


class EagleHead(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        self.layer = DecoderLayer(config, 0)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, angles, cache: KVCache,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """embeds, features: [T, hidden] -> estimated target hidden states [T, hidden]."""
        return self.layer(self.fc(torch.cat((embeds, features), dim=-1)), angles, cache, mask)


@dataclass
class EagleSettings:
    """Drafting settings chosen by measurement and stored in the artifact (defaults for the method)."""

    depth: int = 6  # deepest draft node
    width: int = 4  # candidates per expanded node, and nodes expanded per level
    budget: int = 8  # draft nodes sent to verification
    min_prob: float = 0.0  # stop growing when the best frontier path is less likely than this


@dataclass
class EagleArtifact(TrainedArtifact):
    """A trained head for one model (`weights`: the EagleHead's state)."""

    HEADER: ClassVar[ArtifactKind] = ArtifactKind("specee-eagle", 1, "EAGLE drafter", "specee train eagle")
    SETTINGS: ClassVar[type] = EagleSettings


class EagleModel:
    """The loaded head, ready to draft for one target: shared read-only by every request."""

    def __init__(self, target: Transformer, artifact: EagleArtifact) -> None:
        self.target, self.artifact, self.settings = target, artifact, artifact.settings
        self.head, self.vocab, self.scorer, self.pass_bytes = load_trained(EagleHead(target.config), artifact, target)

    def log_probs(self, estimates: torch.Tensor) -> torch.Tensor:
        """[T, hidden] estimated hidden states -> [T, N] log-probabilities over the reduced vocabulary."""
        return self.scorer(self.target.norm(estimates)).float().log_softmax(-1)


@dataclass
class DraftNode:
    token: int
    parent: int  # -1: a child of the root
    depth: int
    score: float  # log-probability of the path from the root
    estimate: torch.Tensor | None = None  # the head's output at this node once it was expanded


class EagleDrafter(Proposer):
    """Drafts a tree per step (EAGLE-2's dynamic tree): expand the `width` best nodes of each level
    by path probability, one head pass per level, then keep the `budget` best nodes overall.

    With `lookup` (the eagle-copy method), prompt lookup's copy joins the tree as one more path,
    each copied token as likely as the copy's measured reliability, and where the copy is at
    least `copy_alone` reliable the step drafts the copy alone and skips the head (staged
    drafting: the cheap drafter stands in for the learned one where it is as good)."""

    wants_features = True

    def __init__(self, eagle: EagleModel, depth: int, width: int, budget: int, min_prob: float,
                 lookup: PromptLookup | None = None, copy_alone: float = 1.0) -> None:
        self.eagle = eagle
        self.depth, self.width, self.budget = depth, width, budget
        self.min_log_prob = float("-inf") if min_prob <= 0 else float(torch.tensor(min_prob).log())
        self.lookup = lookup
        self.copy_alone = copy_alone
        self.cache: KVCache | None = None
        self.fed = 0  # the head's cache holds positions 1..fed (position 0 has no previous state)
        self.pending: list[torch.Tensor] = []  # target states of positions fed.. not yet given to the head

    def reset(self, prompt: list[int], sampler: Sampler | None) -> None:
        self.cache = drafter_cache(self.eagle.target)
        self.fed = 0
        self.pending = []
        if self.lookup is not None:
            self.lookup.reset(prompt)

    def update(self, context: list[int], num_accepted: int) -> None:
        if self.lookup is not None:
            self.lookup.update(context, num_accepted)

    def observe(self, features: torch.Tensor) -> None:
        """The target's last hidden states of the next committed positions, in order."""
        self.pending.append(features)

    def _run(self, tokens: list[int], features: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None) -> torch.Tensor:
        target = self.eagle.target
        ids = torch.tensor(tokens, device=target.device)
        self.bytes_read += self.eagle.pass_bytes
        return self.eagle.head(target.embed(ids), features.to(target.dtype), target.angles(positions), self.cache, mask)

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        reliability, copied = self.lookup.reliable_chain(context, max_tokens) if self.lookup else (0.0, [])
        if copied and reliability >= self.copy_alone:
            return Draft.chain(copied)  # the head catches up on these states at its next step
        device = self.eagle.target.device
        self.cache.truncate(self.fed)  # forget the last step's draft nodes
        # Positions fed+1 .. len(context)-1 pair each committed token with the state before it.
        features = torch.cat(self.pending)
        self.pending = []
        if features.shape[0] != len(context) - 1 - self.fed:
            raise RuntimeError("EAGLE drafter: the target's states are out of step with the context")
        estimates = self._run(context[self.fed + 1:], features, torch.arange(self.fed + 1, len(context), device=device),
                              None)
        self.fed = len(context) - 1
        root_position = len(context) - 1
        nodes: list[DraftNode] = []
        frontier = self._children(estimates[-1:], [-1], [0.0], 1, nodes)
        expanded: list[int] = []  # node ids in the head cache's order after the committed part
        for depth in range(1, min(self.depth, max_tokens)):
            frontier = sorted(frontier, key=lambda i: -nodes[i].score)[: self.width]
            if not frontier or nodes[frontier[0]].score < self.min_log_prob:
                break
            growing = [nodes[i] for i in frontier]
            parent_states = torch.cat([nodes[n.parent].estimate if n.parent >= 0 else estimates[-1:] for n in growing])
            expanded += frontier
            mask = self._tree_mask(frontier, expanded, nodes).to(device)
            positions = torch.full((len(frontier),), root_position + depth, device=device)
            out = self._run([n.token for n in growing], parent_states, positions, mask)
            for node, row in zip(growing, out):
                node.estimate = row[None]
            frontier = self._children(out, frontier, [n.score for n in growing], depth + 1, nodes)
        if copied:
            merge_path(nodes, copied, math.log(reliability))
        keep = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, i))[: self.budget]
        keep.sort()  # creation order is topological: parents were made before their children
        index = {node: k for k, node in enumerate(keep)}
        return Draft([nodes[i].token for i in keep], [index[nodes[i].parent] if nodes[i].parent >= 0 else -1 for i in keep])

    def _children(self, estimates: torch.Tensor, parents: list[int], scores: list[float], depth: int,
                  nodes: list[DraftNode]) -> list[int]:
        top = self.eagle.log_probs(estimates).topk(self.width, dim=-1)
        tokens = self.eagle.vocab[top.indices].tolist()
        made = []
        for parent, score, row_tokens, row_logp in zip(parents, scores, tokens, top.values.tolist()):
            for token, logp in zip(row_tokens, row_logp):
                made.append(len(nodes))
                nodes.append(DraftNode(token, parent, depth, score + logp))
        return made

    @staticmethod
    def _tree_mask(new: list[int], expanded: list[int], nodes: list[DraftNode]) -> torch.Tensor:
        """[len(new), len(expanded)]: each new node sees its expanded ancestors and itself."""
        mask = torch.zeros(len(new), len(expanded), dtype=torch.bool)
        slot = {node: k for k, node in enumerate(expanded)}
        for row, node in enumerate(new):
            while node >= 0:
                if node in slot:
                    mask[row, slot[node]] = True
                node = nodes[node].parent
        return mask


def merge_path(nodes: list[DraftNode], tokens: list[int], token_log_prob: float) -> None:
    """Merge a chain from the root into the tree: a node the tree already has keeps the better
    of its two scores; the rest are added (after their parents, so the order stays topological)."""
    parent, score = -1, 0.0
    for depth, token in enumerate(tokens, start=1):
        score += token_log_prob
        same = next((i for i, n in enumerate(nodes) if n.parent == parent and n.token == token), None)
        if same is None:
            nodes.append(DraftNode(token, parent, depth, score))
            same = len(nodes) - 1
        else:
            nodes[same].score = max(nodes[same].score, score)
        parent = same


# eagle-copy: the copy alone from this reliability up (a match of 4+ tokens by the copy prior);
# tuned on the tuning slice (BENCHMARKS.md).
COPY_ALONE = 0.7
COPY_LENGTH = 8  # eagle-copy: copies run this deep unless the user sets a draft length


def _eagle_method(copy: bool):
    def build(config, artifacts) -> Drafting:
        """The head's own tree, shaped by the settings stored in its artifact unless options
        override them; with `copy`, prompt lookup's copies mixed in, which may run deeper than the
        head drafts (the head still stops at `depth`)."""
        eagle = artifacts.load("eagle", config.drafter)
        settings = eagle.settings
        depth = config.num_draft_tokens or settings.depth
        width = config.tree_width or settings.width
        budget = config.tree_budget or settings.budget
        min_prob = settings.min_prob if config.tree_min_prob is None else config.tree_min_prob
        if not copy:
            return Drafting(lambda: EagleDrafter(eagle, depth, width, budget, min_prob), depth, budget, width, False)
        copy_length = max(depth, config.num_draft_tokens or COPY_LENGTH)
        copy_alone = COPY_ALONE if config.copy_alone is None else config.copy_alone
        return Drafting(lambda: EagleDrafter(eagle, depth, width, budget, min_prob,
                                             PromptLookup(num_draft_tokens=copy_length), copy_alone),
                        copy_length, budget, width, False)

    return build


register_artifact(ArtifactLoader("eagle", lambda path, store: EagleModel(store.model, EagleArtifact.load(path, store.model)),
                                 "the eagle method needs --drafter FILE"))
register(SpecMethod("eagle", _eagle_method(copy=False), own_tree=True, options=("drafter",), bench={"eagle": {}}))
register(SpecMethod("eagle-copy", _eagle_method(copy=True), own_tree=True, options=("drafter", "copy_alone"),
                    bench={"eagle-copy": {}}))
