"""Passes over the rows of several sequences at once, each attending to its own cache only (a
server batch's shared pass), and the layers of a pass as one call of the CPU kernels. The functions
take the model (a `llama.Transformer`); the model runs one sequence's pass itself (`Passes`)."""
from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from .attention_bias import AttentionBias
from .cache import KVCache
from .rope import RopeAngles, angles_rows
from .thread_governor import governed


class Segment(NamedTuple):
    """One sequence's share of a pass over several: its cache, its attention bias, its row count."""

    cache: KVCache
    bias: AttentionBias
    rows: int


class PassRows(NamedTuple):
    """One sequence's new rows for a pass: token ids and positions [T], the cache they extend, the
    visibility of draft nodes (`mask`, as in `Transformer.hidden`), and the first row that needs
    logits (a prefill chunk needs only its last row's, or none)."""

    ids: torch.Tensor
    positions: torch.Tensor
    cache: KVCache
    mask: torch.Tensor | None = None
    logits_from: int = 0


class LayerRows(NamedTuple):
    """One sequence's rows for one layer, for a pass run layer by layer (early exits decide between
    layers): the layer, its input states [T, hidden], their angles, the cache, the attention bias."""

    layer: int
    h: torch.Tensor
    angles: RopeAngles
    cache: KVCache
    bias: AttentionBias


class Passes(Protocol):
    """What runs a generation's passes of the target: the Transformer itself, or a server batch's
    member, which shares them with the other generations of the batch."""

    def run_pass(self, part: PassRows) -> tuple[torch.Tensor, torch.Tensor]: ...
    def run_layer(self, rows: LayerRows) -> torch.Tensor: ...
    def sharing(self) -> tuple[int, int]:
        """(other generations sharing this one's passes, the rows they ran in the last one)."""
        ...
    def sharing_next(self) -> tuple[int, int]:
        """(other generations sharing this one's passes, the rows they will bring to the next one)."""
        ...


def run_fused(kernels, stack, layers: range, h: torch.Tensor, angles: RopeAngles, segments: list[Segment]
              ) -> torch.Tensor:
    """`layers` (consecutive) for the rows h [T, hidden] of one or more sequences (`segments`, each
    its rows in turn, its cache at one length over those layers) in one kernel call: what running
    them one by one gives, bit for bit."""
    starts = [segment.cache.lengths[layers.start] for segment in segments]
    for segment in segments:
        segment.cache.extend_layers(layers, segment.rows)
    seen = zip(*(segment.bias.for_kernel(start + segment.rows) for segment, start in zip(segments, starts)))
    return kernels.decoder_layers(stack, layers.start, layers.stop, h.contiguous(), *angles_rows(angles, len(h)),
                                  [segment.cache.keys for segment in segments],
                                  [segment.cache.values for segment in segments], starts,
                                  [segment.rows for segment in segments], *seen)


def fusable(cache: KVCache, layers: range) -> bool:
    """Whether `layers` of the cache are all at one length, as one fused call extends them."""
    return len({cache.lengths[i] for i in layers}) == 1


def run_passes(model, parts: list[PassRows]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The rows of several sequences in one pass over the weights, each sequence attending to its
    own cache only. Returns, per part, what `run_pass` returns. On the CPU kernels every row gets
    the bits it gets alone (batch invariance): a sequence's output does not depend on the others."""
    if len(parts) == 1:
        return [model.run_pass(parts[0])]
    with governed(model.thread_governor, sum(len(part.ids) for part in parts)):
        h, angles, segments = begin_passes(model, parts)
        every = range(len(model.layers))
        if model.fused_stack is not None and all(isinstance(s.cache, KVCache) and fusable(s.cache, every)
                                                 for s in segments):
            return end_passes(model, parts, run_fused(*model.fused_stack, every, h, angles, segments))
        for layer in model.layers:
            h = layer(h, angles, segments)
        return end_passes(model, parts, h)


def begin_passes(model, parts: list[PassRows]) -> tuple[torch.Tensor, RopeAngles, list[Segment]]:
    """What the first layer of `run_passes` takes: the parts' embeddings, angles and segments."""
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    segments = [Segment(part.cache, AttentionBias(part.mask, len(part.ids), group), len(part.ids)) for part in parts]
    return (model.embed(torch.cat([part.ids for part in parts])),
            model.angles(torch.cat([part.positions for part in parts])), segments)


def end_passes(model, parts: list[PassRows], h: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split the last layer's states of `run_passes` by part and score the rows that want logits."""
    hidden = h.split([len(part.ids) for part in parts])
    scored = [states[part.logits_from :] for part, states in zip(parts, hidden)]
    if not any(len(rows) for rows in scored):
        return [(states, h.new_empty(0, model.config.vocab_size)) for states in hidden]
    logits = model.logits(model.norm(torch.cat(scored))).split([len(rows) for rows in scored])
    return list(zip(hidden, logits))
