"""A preallocated, rewindable KV cache with one filled length per layer.

Layers keep their own lengths because after an early exit the deeper layers lag behind the
shallow ones until they are caught up; the states that catch them up wait beside the keys and
values (DeferredRows), so a rollback forgets both. Nothing here knows about decoding strategies.
"""
from __future__ import annotations

import torch


class DeferredRows:
    """Positions whose deeper layers have not run (an early exit skipped them), waiting for the next
    pass that reaches their first missing layer: ascending positions, the first layer each misses
    (non-increasing with position) and its input state there."""

    def __init__(self) -> None:
        self.positions: list[int] = []
        self.levels: list[int] = []
        self.states: torch.Tensor | None = None  # [len(positions), hidden]

    def defer(self, states: torch.Tensor, first: int, level: int) -> None:
        """`states` [n, hidden] wait at positions first .. first + n - 1 (the rows there before give
        way), each missing the layers from `level` on."""
        self.truncate(first)
        self.states = states if self.states is None else torch.cat((self.states, states))
        self.positions += range(first, first + len(states))
        self.levels += [level] * len(states)

    def truncate(self, length: int) -> None:
        """Forget the rows at or after position `length`."""
        keep = sum(1 for p in self.positions if p < length)
        self.positions, self.levels = self.positions[:keep], self.levels[:keep]
        self.states = self.states[:keep] if keep else None


class SpareBuffers:
    """The key and value buffers of finished generations' caches, kept for the next ones: a fresh
    buffer of tens of MB is mapped anew and faulted in page by page, which cost a prefix-cache hit
    half its time to first token; a reused one is resident. At most `budget` bytes are kept, the
    oldest given up first."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def nbytes(self) -> int:
        return sum(keys.nbytes + values.nbytes for keys, values in self.buffers)

    def take(self, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device | str
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The smallest kept pair that holds `shape` ([layers, kv_heads, capacity, head_dim]: as
        many positions or more), no longer kept; None when none does."""
        fits = [pair for pair in self.buffers
                if pair[0].dtype == dtype and pair[0].device == torch.device(device) and pair[0].shape[:2] == shape[:2]
                and pair[0].shape[3] == shape[3] and pair[0].shape[2] >= shape[2]]
        if not fits:
            return None
        best = min(fits, key=lambda pair: pair[0].shape[2])
        self.buffers = [pair for pair in self.buffers if pair is not best]
        return best

    def give(self, cache: "KVCache") -> None:
        """Keep the buffers of a cache whose generation has ended; the cache holds none after."""
        pair = (cache.keys, cache.values)
        cache.keys = cache.values = None
        if pair[0].nbytes + pair[1].nbytes > self.budget:
            return
        self.buffers.append(pair)
        while self.nbytes > self.budget:
            self.buffers.pop(0)


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", capacity: int | None = None,
                 spares: SpareBuffers | None = None) -> None:
        """Holds up to `max_len` positions per layer. `capacity` slots are allocated now (all of
        them by default; more than `max_len` only leaves room for a later cache to reuse; taken from
        `spares` where a kept pair holds them); a full cache doubles its allocation, up to `max_len`,
        so a request that may run to a long context pays only for what it writes."""
        self.max_len = max_len
        capacity = max_len if capacity is None else capacity
        shape = (num_layers, num_kv_heads, max(capacity, 1), head_dim)
        # Unwritten slots are never read (attention and keep() see only the filled part).
        kept = spares.take(shape, dtype, device) if spares is not None else None
        if kept is not None:
            self.keys, self.values = kept
        else:
            self.keys = torch.empty(shape, dtype=dtype, device=device)
            self.values = torch.empty(shape, dtype=dtype, device=device)
        self.lengths = [0] * num_layers
        self.deferred = DeferredRows()

    def copy(self) -> "KVCache":
        """An independent cache holding what this one holds (its filled part, its deferred rows)."""
        twin = KVCache.__new__(KVCache)
        twin.max_len, twin.lengths = self.max_len, list(self.lengths)
        twin.keys, twin.values = self.keys.clone(), self.values.clone()
        twin.deferred = DeferredRows()
        twin.deferred.positions, twin.deferred.levels = list(self.deferred.positions), list(self.deferred.levels)
        twin.deferred.states = None if self.deferred.states is None else self.deferred.states.clone()
        return twin

    @property
    def capacity(self) -> int:
        """Positions allocated now."""
        return self.keys.shape[2]

    def _reserve(self, length: int) -> None:
        if length > self.max_len:
            raise ValueError(f"KV cache full: {length} positions needed, at most {self.max_len}")
        if length > self.capacity:
            grown = min(self.max_len, max(length, 2 * self.capacity))
            keys = self.keys.new_empty(*self.keys.shape[:2], grown, self.keys.shape[3])
            values = torch.empty_like(keys)
            filled = self.length
            keys[:, :, :filled] = self.keys[:, :, :filled]
            values[:, :, :filled] = self.values[:, :, :filled]
            self.keys, self.values = keys, values

    @property
    def num_layers(self) -> int:
        return len(self.lengths)

    @property
    def length(self) -> int:
        """Length of the longest layer: the number of positions written so far."""
        return max(self.lengths)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v ([T, kv_heads, head_dim]) after the layer's filled part.

        Returns views of everything the layer holds now: ([kv_heads, S, head_dim], same).
        """
        start = self.lengths[layer]
        end = start + k.shape[0]
        self._reserve(end)
        self.keys[layer, :, start:end] = k.transpose(0, 1)
        self.values[layer, :, start:end] = v.transpose(0, 1)
        self.lengths[layer] = end
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def write_prefix(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append keys and values [layers, kv_heads, n, head_dim] to every layer of a cache whose
        layers are all filled alike, in one copy."""
        start = self.length
        if any(length != start for length in self.lengths):
            raise ValueError("write_prefix: the layers are filled unevenly")
        end = start + keys.shape[2]
        self._reserve(end)
        self.keys[:, :, start:end] = keys
        self.values[:, :, start:end] = values
        self.lengths = [end] * self.num_layers

    def extend(self, layer: int, n: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Make room for `n` positions after the layer's filled part and count them as filled, for
        a kernel that writes them itself. Returns (their first index, the layer's keys and values
        [kv_heads, capacity, head_dim])."""
        start = self.lengths[layer]
        self._reserve(start + n)
        self.lengths[layer] = start + n
        return start, self.keys[layer], self.values[layer]

    def extend_layers(self, layers: range, n: int) -> None:
        """`extend` for each of `layers` (all at one length), without the views a caller that
        passes the whole cache to the kernels does not need."""
        end = self.lengths[layers.start] + n
        self._reserve(end)
        self.lengths[layers.start : layers.stop] = [end] * len(layers)

    def truncate(self, length: int) -> None:
        """Forget every position at or after `length`, in every layer and among the deferred rows."""
        self.lengths = [min(n, length) for n in self.lengths]
        self.deferred.truncate(length)

    def keep(self, start: int, indices: torch.Tensor | list[int]) -> None:
        """Compact the positions `indices` (absolute slots, ascending, all >= start) into the
        contiguous slots start, start + 1, ...; everything after them is forgotten.

        Used after tree verification: the accepted path's entries move next to the prefix.
        Applies to every layer that has written past `start`.
        """
        index = torch.as_tensor(indices, dtype=torch.long, device=self.keys.device)
        n = index.numel()
        if n and (int(index.min()) < start or int(index.max()) >= self.length):
            raise ValueError("keep: indices must lie in the written part of the cache, at or after start")
        layers = [i for i, length in enumerate(self.lengths) if length > start]
        if len(layers) == self.num_layers:
            # One gather for all layers at once (the common case: nobody lags).
            self.keys[:, :, start : start + n] = self.keys.index_select(2, index)
            self.values[:, :, start : start + n] = self.values.index_select(2, index)
        else:
            for i in layers:
                self.keys[i, :, start : start + n] = self.keys[i].index_select(1, index)
                self.values[i, :, start : start + n] = self.values[i].index_select(1, index)
        for i in layers:
            self.lengths[i] = start + n
