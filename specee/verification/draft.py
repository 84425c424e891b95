"""The draft a proposer hands to verification: tokens arranged as a tree (a chain is a tree)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Draft:
    """Draft tokens as a tree; a chain is the tree whose node i has parent i - 1.

    Nodes are in topological order (a parent comes before its children). The root is the last
    token already committed to the output; it is not part of the draft.
    """

    tokens: list[int]  # [n] drafted token ids
    parents: list[int]  # [n] parent node index of each node, -1 for a child of the root
    # The distribution each node was drawn from (its parent's next-token distribution after the
    # same temperature/top-k/top-p processing as the target). None: chosen deterministically, so
    # verification treats each node as a one-hot draft.
    q: torch.Tensor | None = None  # [n, vocab]
    # True when siblings were drawn independently from q (so verification may use q); False when
    # they are distinct deterministic picks (top-k), which verification treats as one-hot drafts.
    sampled: bool = False
    # Double early exit: the states of [root] + nodes after the target's first layers, which the
    # drafter already ran in the target's own cache, so verification starts above them.
    shallow: torch.Tensor | None = None  # [n + 1, hidden]
    # The method that drafted it, where a policy chooses among several (`auto`); None: the strategy's own.
    source: str | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    @staticmethod
    def chain(tokens: list[int], q: torch.Tensor | None = None, sampled: bool = False,
              shallow: torch.Tensor | None = None, source: str | None = None) -> "Draft":
        return Draft(list(tokens), list(range(-1, len(tokens) - 1)), q, sampled, shallow, source)

    @staticmethod
    def empty() -> "Draft":
        return Draft([], [])
