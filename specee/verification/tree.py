"""Draft trees: their layout for one verification pass, and the two ways to grow them.

A tree is verified in one target pass over the inputs [root] + nodes: each input attends to the
committed prefix, to the root, to its ancestors and to itself, and sits at position
prefix_len + depth. Trees are grown either from a fixed shape of top-k ranks (static, the
Medusa/vLLM path lists) or best-first under a node budget (dynamic).
"""
from __future__ import annotations

import heapq
import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .draft import Draft

# A drafter's ranked guesses for the token after a path: (token id, probability), most likely first.
Candidates = Sequence[tuple[int, float]]
# Called with the draft tokens from the root's child down to a node (empty for the root); returns
# that node's ranked candidate children.
Expand = Callable[[tuple[int, ...]], Candidates]


@dataclass
class TreeLayout:
    """Depths, children and attention of a draft tree whose nodes are in topological order."""

    parents: list[int]  # [n] parent node index of each node, -1 for a child of the root
    depths: list[int] = field(init=False)  # [n] the root's children have depth 1
    _children: list[list[int]] = field(init=False, repr=False)  # [n + 1] indexed by parent + 1

    def __post_init__(self) -> None:
        self.parents = list(self.parents)
        self.depths = []
        self._children = [[] for _ in range(len(self.parents) + 1)]
        for node, parent in enumerate(self.parents):
            if not -1 <= parent < node:
                raise ValueError(
                    f"node {node} has parent {parent}: parents must come before their children"
                )
            self.depths.append(1 if parent == -1 else self.depths[parent] + 1)
            self._children[parent + 1].append(node)

    @staticmethod
    def of(draft: Draft) -> "TreeLayout":
        return TreeLayout(draft.parents)

    def children(self, node: int) -> list[int]:
        """Child nodes of `node` in draft order; `node` = -1 is the root."""
        return self._children[node + 1]

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's child down to `node`, inclusive."""
        path = []
        while node != -1:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def attention_mask(self, include_root: bool = True) -> torch.Tensor:
        """True where input i may attend to input j, over [root] + nodes (or nodes alone).

        The committed prefix is not part of the mask: every input may attend to all of it.
        """
        n = len(self.parents)
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)  # [n + 1, n + 1] over [root] + nodes
        mask[:, 0] = True
        for node, parent in enumerate(self.parents):
            # Parents come first, so the parent's row already holds all of its ancestors.
            mask[node + 1] = mask[parent + 1]
            mask[node + 1, node + 1] = True
        return mask if include_root else mask[1:, 1:]

    def positions(self, prefix_len: int) -> torch.Tensor:
        """Positions of [root] + nodes when the root sits at `prefix_len`."""
        return torch.tensor([prefix_len, *(prefix_len + depth for depth in self.depths)], dtype=torch.long)  # [n + 1]


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree shape: each node is a path of top-k ranks, one rank per depth.

    `(0,)` is the drafter's best guess after the root, `(0, 1)` its second-best guess after that.
    """

    paths: tuple[tuple[int, ...], ...]  # topologically ordered: by depth, then by ranks
    parents: tuple[int, ...]  # [n] index into `paths`, -1 for a child of the root

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def width(self) -> int:
        """Candidates a node must offer to fill every rank in the shape."""
        return 1 + max(ranks[-1] for ranks in self.paths)

    def fill(self, expand: Expand) -> Draft:
        """Put ranked candidates into the shape: node (..., r) gets rank r after its parent.

        `expand` is called once per node that has children in the shape. A node whose rank is past
        the end of its parent's candidates is dropped with its subtree, so a drafter that offers
        fewer guesses gives a smaller tree rather than an error.
        """
        tokens: list[int] = []
        parents: list[int] = []
        draft_index: dict[int, int] = {-1: -1}  # shape node -> draft node, for kept nodes
        path_tokens: dict[int, tuple[int, ...]] = {-1: ()}
        ranked: dict[int, list[int]] = {}  # shape node -> its candidate tokens, best first
        for node, (ranks, parent) in enumerate(zip(self.paths, self.parents)):
            if parent not in draft_index:
                continue
            if parent not in ranked:
                ranked[parent] = [token for token, _ in expand(path_tokens[parent])]
            rank = ranks[-1]
            if rank >= len(ranked[parent]):
                continue
            token = ranked[parent][rank]
            draft_index[node] = len(tokens)
            path_tokens[node] = path_tokens[parent] + (token,)
            tokens.append(token)
            parents.append(draft_index[parent])
        return Draft(tokens, parents)


def static_tree(paths: Sequence[Sequence[int]]) -> StaticTree:
    """Check a list of rank paths and order it so parents come before children."""
    if not paths:
        raise ValueError("a static tree needs at least one path")
    unique = set()
    for path in paths:
        path = tuple(path)
        if not path:
            raise ValueError("a tree path cannot be empty: the root is implicit")
        if any(not isinstance(rank, int) or rank < 0 for rank in path):
            raise ValueError(f"tree path {path}: ranks must be non-negative integers")
        if path in unique:
            raise ValueError(f"tree path {path} appears twice")
        unique.add(path)
    for path in unique:
        if len(path) > 1 and path[:-1] not in unique:
            raise ValueError(f"tree path {path} has no parent: {path[:-1]} is missing")
    ordered = sorted(unique, key=lambda path: (len(path), path))
    index = {path: i for i, path in enumerate(ordered)}
    parents = tuple(index[path[:-1]] if len(path) > 1 else -1 for path in ordered)
    return StaticTree(tuple(ordered), parents)


def parse_tree_paths(text: str) -> list[tuple[int, ...]]:
    """Read rank paths from a CLI string: "0;1;0,0;0,1" or the JSON list [[0],[1],[0,0],[0,1]]."""
    text = text.strip()
    try:
        if text.startswith("["):
            raw = json.loads(text)
            if not isinstance(raw, list) or not all(isinstance(path, list) for path in raw):
                raise ValueError("expected a JSON list of lists")
            return [tuple(path) for path in raw]
        return [tuple(int(rank) for rank in path.split(",")) for path in text.split(";")]
    except ValueError as error:
        raise ValueError(
            f"cannot read tree paths {text!r} ({error}); "
            'write them like "0;1;0,0;0,1" or [[0],[1],[0,0],[0,1]]'
        ) from None


def dynamic_tree(
    expand: Expand, budget: int, max_depth: int, min_prob: float = 0.0, node_cost: float = 0.0
) -> Draft:
    """Grow the `budget` nodes whose paths from the root are most probable, best first.

    Compute goes where acceptance is likely: to a strong second guess near the root rather than to
    the far end of a long chain. Because a child is never more probable than its parent, a node is
    only expanded when its own probability reaches the top of the heap; by then every child it can
    add is at most as probable, so the order stays exact and no expansion is wasted at the end.
    Growth also stops when the best remaining path is less probable than `min_prob` (the
    drafter's confidence has run out), so the tree may come back smaller than `budget`.

    `node_cost` is what one more input adds to the verification pass, as a fraction of a
    one-token pass. A node is worth adding while it raises the expected tokens per unit of pass
    cost, (1 + sum of path probabilities) / (1 + node_cost * nodes): since nodes come in falling
    probability, growth stops at the first one that would lower it.
    """
    expected = 1.0  # tokens the pass is expected to yield: the target's own token plus each node's
    tokens: list[int] = []
    parents: list[int] = []
    paths: list[tuple[int, ...]] = []
    tie_break = itertools.count()  # equal probabilities keep the order they were offered in
    # Entries: (-path probability, tie break, parent node, token); token None = expand the parent.
    heap: list[tuple[float, int, int, int | None]] = [(-1.0, next(tie_break), -1, None)]
    while heap and len(tokens) < budget:
        neg_prob, _, parent, token = heapq.heappop(heap)
        # Every entry left (and every child of one) is at most this probable.
        if -neg_prob < min_prob or -neg_prob * (1 + node_cost * len(tokens)) < node_cost * expected:
            break
        if token is None:
            for child_token, prob in expand(paths[parent] if parent >= 0 else ()):
                if prob > 0:
                    heapq.heappush(heap, (neg_prob * prob, next(tie_break), parent, child_token))
            continue
        node = len(tokens)
        expected -= neg_prob
        tokens.append(token)
        parents.append(parent)
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
        if len(paths[node]) < max_depth:
            heapq.heappush(heap, (neg_prob, next(tie_break), node, None))
    return Draft(tokens, parents)
