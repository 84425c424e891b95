"""Which draft tokens the target accepts, and the one token it adds after them.

Both rules take the target's next-token distributions at the root and at every draft node, in one
tensor whose row 0 follows the root and row i + 1 follows node i, and return
(accepted nodes from the root down, next token). The next token is the correction after a
rejection, or the bonus token when a whole path is accepted.
"""
from __future__ import annotations

import torch

from .draft import Draft
from .tree import TreeLayout


def accept_greedy(draft: Draft, target_argmax: torch.Tensor, layout: TreeLayout | None = None) -> tuple[list[int], int]:
    """Follow the children whose token is the target's argmax; output = plain greedy decoding.
    `layout`: the draft's, where the caller has it."""
    argmax = target_argmax.tolist()  # [n + 1]; one host read for the whole tree
    if draft.is_chain:  # a chain's children are its next node: no layout needed
        kept = 0
        while kept < len(draft) and draft.tokens[kept] == argmax[kept]:
            kept += 1
        return list(range(kept)), argmax[kept]
    layout = TreeLayout.of(draft) if layout is None else layout
    accepted: list[int] = []
    node = -1
    while True:
        wanted = argmax[node + 1]
        match = next((c for c in layout.children(node) if draft.tokens[c] == wanted), None)
        if match is None:
            return accepted, wanted
        accepted.append(match)
        node = match


def accept_sampling(
    draft: Draft, target_probs: torch.Tensor, generator: torch.Generator
) -> tuple[list[int], int]:
    """Speculative rejection sampling over a chain or tree; output ~ the target's distribution.

    At a node whose next-token distribution is p, the children are tried in order against a
    residual r, starting with r = p. A child x drafted from q is accepted with probability
    min(1, r(x) / q(x)); on rejection r <- normalize(max(r - q, 0)). If every child is rejected,
    the next token is drawn from the final r. A deterministic child (q is None or siblings are not
    i.i.d. draws) is the draft q = one-hot(x): accept with probability r(x), else zero r(x) and
    renormalize.

    Why this is exact: one round with residual r and a candidate x ~ q outputs y with probability
    q(y) min(1, r(y)/q(y)) + (1 - sum min(q, r)) * max(r(y) - q(y), 0) / (1 - sum min(q, r))
    = min(q(y), r(y)) + max(r(y) - q(y), 0) = r(y). So if the rounds after this one together
    output ~ normalize(max(r - q, 0)), this round outputs ~ r; the last "round" samples the final
    residual directly, and induction from the last sibling back to the first gives output ~ p.
    This needs each candidate to be independent of the earlier rounds given the path, which holds
    for i.i.d. siblings and trivially for deterministic ones. Given the accepted child, its
    subtree was drafted after that child alone, so the same argument repeats one level down with
    the target's row for that child: the joint output is the target's sequence distribution.

    A residual can come out all-zero only through rounding (exactly, r <= q everywhere forces
    r = q and acceptance with probability 1); it then falls back to the residual before the
    subtraction. Every random draw uses `generator`, which must live on target_probs' device.
    """
    layout = TreeLayout.of(draft)
    use_q = draft.sampled and draft.q is not None
    # One uniform per node, drawn up front: each node is tried at most once.
    uniforms = torch.rand(len(draft), generator=generator, device=target_probs.device).tolist()
    accepted: list[int] = []
    node = -1
    while True:
        residual = target_probs[node + 1].float()  # [vocab]
        for child in layout.children(node):
            token = draft.tokens[child]
            q = draft.q[child].float() if use_q else None  # [vocab] or one-hot(token)
            q_token = q[token].item() if q is not None else 1.0
            # u < r(x) / q(x) written without the division, so q(x) = 0 cannot give NaN.
            if uniforms[child] * q_token < residual[token].item():
                accepted.append(child)
                node = child
                break
            residual = _residual_after_rejection(residual, token, q)
        else:
            next_token = torch.multinomial(residual, 1, generator=generator).item()
            return accepted, next_token


def _residual_after_rejection(
    residual: torch.Tensor, token: int, q: torch.Tensor | None
) -> torch.Tensor:
    """normalize(max(r - q, 0)), with q = one-hot(token) when q is None."""
    if q is None:
        left = residual.clone()
        left[token] = 0.0
    else:
        left = (residual - q).clamp_(min=0.0)
    total = left.sum()
    # torch.where keeps the fallback on the device (no host read); 0/0 in the unused branch is fine.
    return torch.where(total > 0, left / total, residual)
