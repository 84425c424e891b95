"""Lossless speculative decoding: draft -> verify in one target pass -> extend.

Each step runs the target over [root] + draft nodes (a chain, or a tree with a tree attention
mask), accepts the longest path the target agrees with (greedy) or would have sampled (rejection
sampling), adds the target's own next token after it, and rewinds the KV cache to that path.
A drafter that shares the target's first layers (Kangaroo) has already run them for the root and
the draft, in the target's cache, so the verification pass starts above them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple

import torch

from ..drafters.base import Proposer
from ..model.passes import PassRows
from ..sampling import argmax
from ..verification.acceptance import accept_greedy, accept_sampling
from ..verification.draft import Draft
from ..verification.tree import StaticTree, TreeLayout, dynamic_tree
from .base import DecodeState, Step, Strategy
from .config import MAX_DRAFT_NODES


@dataclass
class DraftLength:
    """How many tokens a chain drafts next. Adaptive rule (Hugging Face assisted generation's,
    capped): after a pass that accepted every draft token, draft 2 more; after any rejection, 1
    fewer; always between 1 and `maximum`, the user's draft length (on CPU a pass over 17 tokens
    costs ~1.5x one token, so growing past it rarely pays). Trees do not adapt: their size is
    the node budget, their depth at most `maximum`."""

    current: int
    maximum: int
    adaptive: bool = True

    def update(self, proposed: int, accepted: int) -> None:
        if not self.adaptive or proposed == 0:
            return
        step = 2 if accepted == proposed else -1
        self.current = max(1, min(self.maximum, self.current + step))


class Speculative(Strategy):
    """A recipe: the options and a way to make a proposer. Each `decode` makes its own proposer,
    so one strategy can serve any number of generations, one after another or at once."""

    def __init__(
        self,
        make_proposer: Callable[[], Proposer],
        num_draft_tokens: int = 8,
        tree: StaticTree | str | None = None,  # None: chain; "auto": dynamic tree; else a static shape
        tree_budget: int = 4,
        tree_width: int = 4,  # dynamic trees: candidates per node (a static shape sets its own)
        adaptive: bool = True,
        name: str = "speculative",
        tree_min_prob: float = 0.0,
        node_cost: float = 0.0,
        shallow_layers: int | None = None,
    ) -> None:
        sizes = {"num_draft_tokens": num_draft_tokens, "tree_budget": tree_budget, "tree_width": tree_width}
        for size, value in sizes.items():
            if not 1 <= value <= MAX_DRAFT_NODES:
                raise ValueError(f"{size} must be in 1..{MAX_DRAFT_NODES}, got {value}")
        if isinstance(tree, StaticTree) and len(tree) > MAX_DRAFT_NODES:
            raise ValueError(f"a static tree may have at most {MAX_DRAFT_NODES} nodes, got {len(tree)}")
        proposer = make_proposer()
        if tree is not None and not proposer.drafts_trees:
            raise ValueError(f"{type(proposer).__name__} drafts chains only; drop the tree option")
        self.make_proposer = make_proposer
        self.reads_features = proposer.wants_features  # its drafter reads the prompt's last-layer states
        self.num_draft_tokens = num_draft_tokens
        self.tree = tree
        self.tree_budget = tree_budget
        self.tree_width = tree.width if isinstance(tree, StaticTree) else tree_width
        self.adaptive = adaptive
        self.name = name
        self.tree_min_prob = tree_min_prob  # stop growing a dynamic tree below this path probability
        self.node_cost = node_cost  # one more tree input, as a fraction of a one-token pass
        # A self-drafter that runs the target's first `shallow_layers` layers itself (Kangaroo):
        # verification runs only the layers above them on the drafter's states.
        self.shallow_layers = shallow_layers

    def draft(self, proposer: Proposer, context: list[int], length: int) -> Draft:
        if self.tree is None:
            return proposer.propose(context, length)

        def expand(path: tuple[int, ...]):
            return proposer.candidates(context + list(path), self.tree_width)

        if self.tree == "auto":
            return dynamic_tree(expand, budget=self.tree_budget, max_depth=self.num_draft_tokens,
                                min_prob=self.tree_min_prob, node_cost=self.node_cost)
        return self.tree.fill(expand)

    def start_proposer(self, tokens: list[int], sampler, cache, hidden, shallow, passes=None, stats=None) -> Proposer:
        """A fresh proposer after the prefill of `tokens`, given the target's states a drafter
        reads (`hidden`, the last layer's) or shares (`shallow`, with the cache they are in)."""
        proposer = self.make_proposer()
        proposer.reset(tokens, sampler)
        proposer.watch(passes, stats)
        if proposer.wants_features:
            proposer.observe(hidden)
        if self.shallow_layers:
            proposer.share_target(cache, shallow)
        return proposer

    def decode(self, state: DecodeState, verifier: FullPass | None = None) -> Iterator[Step]:
        """Draft, verify, extend: the one speculative loop. `verifier` (default: one full pass) runs
        the target over the root and the draft, accepts, and rewinds the cache to the accepted path."""
        tokens, stats = state.tokens, state.stats
        proposer = self.start_proposer(tokens, state.sampler, state.cache, state.hidden, state.shallow,
                                       state.passes, stats)
        if proposer.wants_features:
            state.final_states.append(state.hidden)
        verifier = verifier or FullPass(state, self.shallow_layers)
        length = DraftLength(self.num_draft_tokens, self.num_draft_tokens, self.adaptive)
        root = int(state.sampler.pick(state.sampler.adjusted(state.logits, tokens))[0])
        tokens.append(root)
        yield Step([root], logits=state.logits)
        verifier.update(tokens, 0)
        while True:
            began = time.perf_counter()
            # Tokens a grammar forces are free drafts (jump-forward); a drafter sharing the
            # target's layers drafts every step, since its drafts extend the target's cache.
            forced = [] if self.shallow_layers else state.sampler.forced(tokens)
            if forced:
                draft, method = Draft.chain(forced[:MAX_DRAFT_NODES]), "grammar"
            else:
                proposed_draft = self.draft(proposer, tokens, length.current)
                method = proposed_draft.source or self.name
                draft = state.sampler.admissible(tokens, proposed_draft)
            drafted = time.perf_counter()
            layout = TreeLayout.of(draft)
            verified = verifier.verify(tokens, draft, layout)
            accepted = verified.accepted
            new = [draft.tokens[node] for node in accepted] + [verified.next_token]
            if proposer.wants_features:  # the accepted path's states, where the pass ended
                accepted_states = verified.hidden[verified.rows]
                proposer.observe(accepted_states)
                state.final_states.append(accepted_states)
            tokens.extend(new)
            proposed = max(layout.depths, default=0)
            stats.record_pass(proposed, len(accepted))
            stats.record_method(method if len(draft) else "none")
            stats.draft_s += drafted - began
            stats.verify_s += time.perf_counter() - drafted
            stats.draft_nodes += len(draft)
            stats.weight_bytes += proposer.take_bytes_read()
            if not forced:
                length.update(proposed, len(accepted))
            proposer.update(tokens, len(accepted))
            verifier.update(tokens, len(accepted))
            yield Step(new, len(accepted), verified.exit_layer, verified.logits, verified.rows,
                       method if len(draft) else "none")


class Verified(NamedTuple):
    accepted: list[int]  # the accepted draft nodes, root to leaf
    next_token: int  # the target's own token after them
    logits: torch.Tensor  # [rows, vocab] the pass's logits (row 0: the root's) ...
    hidden: torch.Tensor  # [rows, hidden] ... and its states where it ended
    rows: list[int]  # the rows of the root and the accepted nodes
    exit_layer: int | None = None  # the layers the pass ran, when it stopped early


class FullPass:
    """Verification by one target pass (above a self-drafter's shared layers, which it ran)."""

    def __init__(self, state: DecodeState, shallow_layers: int | None) -> None:
        self.model, self.cache, self.sampler, self.stats = state.model, state.cache, state.sampler, state.stats
        self.passes = state.passes
        self.device = self.model.device
        self.shallow_layers = shallow_layers or 0
        self.deep = range(self.shallow_layers, self.model.config.num_hidden_layers)
        # Counting the deep layers' bytes walks their parameters: done once per generation only
        # where a self-drafter shares the first layers (every other pass reads the whole model).
        self.deep_bytes = (self.model.layers_bytes(self.deep) + self.model.head_bytes if self.shallow_layers
                           else self.model.weight_bytes)

    def verify(self, tokens: list[int], draft: Draft, layout: TreeLayout) -> Verified:
        model, cache = self.model, self.cache
        prefix = cache.lengths[self.shallow_layers]  # the layers the pass runs hold everything before the root
        chain = draft.is_chain
        if chain:  # one position after another (a step's Python is a share of a small model's pass)
            positions = torch.arange(prefix, prefix + len(draft) + 1, device=self.device)
        else:
            positions = layout.positions(prefix).to(self.device)
        mask = None if chain else layout.attention_mask().to(self.device)
        if draft.shallow is None:
            ids = torch.tensor([tokens[-1], *draft.tokens], device=self.device)  # [n + 1]
            hidden, logits = self.passes.run_pass(PassRows(ids, positions, cache, mask))  # [n + 1, hidden / vocab]
            self.stats.weight_bytes += model.weight_bytes
        else:  # the drafter ran the shallow layers for these inputs, in this cache
            hidden = model.run_layers(draft.shallow, positions, cache, mask, self.deep)
            logits = model.logits(model.norm(hidden))
            self.stats.weight_bytes += self.deep_bytes
        scores = logits
        if self.sampler.adjusts:  # row 0 follows the root; row i + 1 the path down to draft node i
            paths = [[]] + [[draft.tokens[n] for n in layout.path_to(node)] for node in range(len(draft))]
            scores = self.sampler.adjusted(logits, tokens, paths)
        if self.sampler.greedy:
            accepted, next_token = accept_greedy(draft, argmax(scores), layout)
        else:
            accepted, next_token = accept_sampling(draft, self.sampler.probs(scores), self.sampler.generator)
        if len(draft):  # a pass of the root alone wrote nothing past it
            keep_path(cache, prefix, draft, accepted)
        return Verified(accepted, next_token, logits, hidden, [0] + [1 + node for node in accepted])

    def update(self, tokens: list[int], num_accepted: int) -> None:
        """Told after each step, as proposers are (a verifier with a drafter of its own follows)."""


def keep_path(cache, prefix: int, draft: Draft, accepted: list[int]) -> None:
    """Rewind the cache to the root (at `prefix`) and the accepted draft nodes."""
    if draft.is_chain:
        cache.truncate(prefix + 1 + len(accepted))
    else:
        cache.keep(prefix, [prefix] + [prefix + 1 + node for node in accepted])
