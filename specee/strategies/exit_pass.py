"""One pass of the target stopped early: after each scheduled layer the exit policy is asked,
row by row, whether to stop, and a firing row's full-head check decides whether the exit stands.
The pass runs the last token and a draft's rows (none in plain decoding).

KV of the layers an exit skipped:
- exact: the exited rows' states wait beside the cache (KVCache.deferred); the next pass that
  reaches their first missing layer takes them along in one batch (LayerSkip), so the cache ends
  up as full passes would have written it for the tokens actually emitted.
- approx: the skipped layers' keys and values are computed from the exit state at once.

Per scheduled layer the decision reads one number back from the device (the predictor's output);
on the CPU that costs nothing, on a GPU it is one synchronisation per scheduled layer.
"""
from __future__ import annotations

import itertools
import time
from typing import Callable, NamedTuple

import torch

from ..exits.features import candidate_logits, exit_features
from ..exits.policy import ExitPolicy
from ..model.attention_bias import AttentionBias
from ..model.cache import KVCache
from ..model.llama import Transformer
from ..model.passes import LayerRows, Passes
from ..model.rope import RopeAngles
from ..stats import GenerationStats

KV_MODES = ("exact", "approx")


class PassResult(NamedTuple):
    logits: torch.Tensor  # [kept rows, vocab]
    layers: int  # layers run
    kept: list[int]  # the rows kept: all of them after a full pass
    hidden: torch.Tensor  # the kept rows' states where the pass stopped (before the final norm)


# The full-head check of some rows of a pass: (their logits [n, vocab], whether the policy confirms
# each exit [n]).
Check = Callable[[list[int]], "tuple[torch.Tensor, list[bool]]"]
# (layer, which rows' policy fired [T], the check) -> None, or the rows to keep (ascending, from
# row 0) and their logits.
Settle = Callable[[int, torch.Tensor, Check], "tuple[list[int], torch.Tensor] | None"]


class ExitPass:
    """Runs one generation's passes (the last token and a draft's rows), stopping them early."""

    def __init__(self, model: Transformer, cache: KVCache, policy: ExitPolicy, kv: str, stats: GenerationStats,
                 on_features: Callable[[int, torch.Tensor], None] | None = None, passes: Passes | None = None) -> None:
        if kv not in KV_MODES:
            raise ValueError(f"exit KV mode must be one of {', '.join(KV_MODES)}, got {kv!r}")
        self.model, self.cache, self.policy, self.kv, self.stats = model, cache, policy, kv, stats
        self.num_layers = model.config.num_hidden_layers
        self.group = model.config.num_attention_heads // model.config.num_key_value_heads
        self.on_features = on_features  # tests: sees (layer, features) of every decision
        self.passes = passes or model  # runs each layer: at once, or shared with a batch's other passes
        # Weight bytes of layers 0..i, for each i (what a pass that exits after layer i read).
        self.layer_bytes = list(itertools.accumulate(model.layers_bytes(range(i, i + 1))
                                                     for i in range(self.num_layers)))

    def _check(self, states: torch.Tensor, first: torch.Tensor, drafter_probs: torch.Tensor
               ) -> tuple[torch.Tensor, list[bool]]:
        """The full head on fired rows' states [n, hidden] at an exit layer (counted as a check):
        (logits [n, vocab], whether the policy confirms each row's exit)."""
        self.stats.exit_checks += 1
        self.stats.weight_bytes += self.model.head_bytes
        logits = self.model.logits(self.model.norm(states))
        return logits, self.policy.confirms(logits, first, drafter_probs).tolist()

    def run(self, tokens: list[int], candidates: torch.Tensor, drafter_probs: torch.Tensor, settle: Settle,
            tree: torch.Tensor | None = None, depths: list[int] | None = None,
            shallow: torch.Tensor | None = None, first_layer: int = 0) -> PassResult:
        """Feed `tokens` (T rows) at the next positions with candidates [T, K] per row. After each
        scheduled layer, `settle(layer, which rows' policy fired [T], check)` may end the pass: it
        may run the full head on some rows (`check(rows)`), and returns (the rows to keep,
        ascending, the first of them row 0, and their logits) or None. On an exit the other rows
        are forgotten and the kept ones move to consecutive positions.

        Rows are causal (a chain) unless `tree` ([T, T] bool: row i sees row j) and `depths` ([T]:
        each row's position after the first's) describe a draft tree. `shallow`: the rows' states
        after the first `first_layer` layers, which a drafter has already run in this cache
        (Kangaroo); else the pass starts from the embeddings."""
        model, cache, stats, policy = self.model, self.cache, self.stats, self.policy
        deferred = cache.deferred
        T = len(tokens)
        position = cache.lengths[first_layer]  # deferred positions only ever lag above first_layer
        num_deferred = len(deferred.positions)
        offsets = torch.arange(T) if depths is None else torch.tensor(depths)
        positions = torch.cat((torch.tensor(deferred.positions, dtype=torch.long), position + offsets))
        all_angles = model.angles(positions.to(model.device))  # rows: deferred, then tokens
        batch = model.embed(torch.tensor(tokens, device=model.device)) if shallow is None else shallow
        start = num_deferred  # index of the first deferred row in the batch
        active = policy.active()
        rows = model.head_rows(candidates.flatten()).view(*candidates.shape, -1)  # [T, K, hidden]
        below = candidate_logits(model, batch, rows).softmax(-1) if active[first_layer] else None
        bias, bias_rows = None, 0
        last = self.num_layers - 1
        for i in range(first_layer, self.num_layers):
            joined = start
            while joined > 0 and deferred.levels[joined - 1] <= i:
                joined -= 1
            if joined < start:
                batch = torch.cat((deferred.states[joined:start], batch))
                start = joined
            first = deferred.positions[start] if start < num_deferred else position
            if cache.lengths[i] != first:
                raise RuntimeError(f"layer {i} holds {cache.lengths[i]} positions, the pass writes from {first}")
            if batch.shape[0] != bias_rows:
                bias, bias_rows = self._bias(batch.shape[0] - T, T, tree), batch.shape[0]
            angles = RopeAngles(all_angles.cos[start:], all_angles.sin[start:])
            batch = self.passes.run_layer(LayerRows(i, batch, angles, cache, bias))
            if i == last or not (active[i] or (i + 1 < last and active[i + 1])):
                continue
            began = time.perf_counter()
            logits = candidate_logits(model, batch[-T:], rows)
            if not active[i]:
                below = logits.softmax(-1)  # the next layer's decision needs this one's
                stats.predictor_s += time.perf_counter() - began
                continue
            features, below = exit_features(logits, below)
            stats.predictors_run += 1
            if self.on_features is not None:
                self.on_features(i, features)
            fired = policy.fires(i, features, below, drafter_probs)
            settled = None
            if bool(fired.any()):
                states = batch[-T:]
                settled = settle(i, fired, lambda rows: self._check(states[rows], candidates[rows, 0],
                                                                     drafter_probs[rows]))
            stats.predictor_s += time.perf_counter() - began
            if settled is not None:
                kept, exit_logits = settled
                states = batch[-T:][kept]
                self._skip(i, torch.cat((batch[: batch.shape[0] - T], states)), first, position, kept)
                policy.exited(i)
                stats.weight_bytes += self._bytes(first_layer, i)  # the check already counted the head
                return PassResult(exit_logits, i + 1, kept, states)
        deferred.truncate(0)  # the full pass caught every deferred row up
        stats.weight_bytes += self._bytes(first_layer, last) + model.head_bytes
        states = batch[-T:]
        return PassResult(model.logits(model.norm(states)), self.num_layers, list(range(T)), states)

    def _bytes(self, first_layer: int, layer: int) -> int:
        """Weight bytes of layers first_layer..layer."""
        return self.layer_bytes[layer] - (self.layer_bytes[first_layer - 1] if first_layer else 0)

    def _bias(self, joined: int, T: int, tree: torch.Tensor | None) -> AttentionBias:
        """The attention of a batch: `joined` deferred rows (causal, first), then the pass's rows
        (causal, or following `tree`), which see every deferred row."""
        if tree is None:
            return AttentionBias(None, joined + T, self.group)
        n = joined + tree.shape[0]
        mask = torch.ones(n, n, dtype=torch.bool, device=tree.device).tril()
        mask[joined:, joined:] = tree
        return AttentionBias(mask, n, self.group)

    def _skip(self, layer: int, waiting: torch.Tensor, first: int, position: int, kept: list[int]) -> None:
        """After an exit at `layer` keeping rows `kept` of the pass that began at `position`:
        those rows move to consecutive positions, the rest are forgotten; the `waiting` states
        (deferred positions from `first` on, then the kept rows) wait for the layers above (exact),
        or the layers above get keys and values from them (approx)."""
        end = position + len(kept)
        if kept == list(range(len(kept))):
            self.cache.truncate(end)
        else:
            self.cache.keep(position, [position + row for row in kept])  # layers above never held them
        if self.kv == "approx":
            angles = self.model.angles(torch.arange(first, end, device=self.model.device))
            for j in range(layer + 1, self.num_layers):
                self.model.layers[j].write_kv(waiting, angles, self.cache)
            return
        self.cache.deferred.defer(waiting, first, layer + 1)
