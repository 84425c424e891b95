"""The prefix cache: K/V of earlier generations, so a prompt that starts like one seen before
(a conversation's next turn, an agent's next call, a shared system prompt) prefills only the rest.

Entries are blocks of BLOCK_TOKENS positions, each keyed by a hash of its tokens and of every
token before it (vLLM's hashed block chain: a block is found only after the same whole prefix, so
reuse is keyed by tokens alone). A block holds the K/V of every layer for its positions and, when
they were at hand (a prompt's prefill), the last layer's states, which feature drafters (EAGLE)
read. Blocks are copied into a generation's own cache, never shared in place, so nothing a
generation writes can change a cached block; they are evicted least recently used under a byte
budget. On the CPU kernels a row's bits do not depend on how the prompt was cut into passes, so a
reused prefix is bit-identical to a recomputed one.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .model.cache import KVCache

BLOCK_TOKENS = 32


@dataclass
class Block:
    keys: torch.Tensor  # [layers, kv_heads, BLOCK_TOKENS, head_dim]
    values: torch.Tensor
    hidden: torch.Tensor | None  # [BLOCK_TOKENS, hidden] the last layer's states, when known

    @property
    def nbytes(self) -> int:
        extra = self.hidden.nbytes if self.hidden is not None else 0
        return self.keys.nbytes + self.values.nbytes + extra


@dataclass
class PrefixCacheStats:
    hits: int = 0  # lookups that found at least one block
    hit_tokens: int = 0  # prompt tokens taken from the cache
    lookups: int = 0
    evictions: int = 0  # blocks evicted for room


class PrefixCache:
    def __init__(self, budget_bytes: int, block_tokens: int = BLOCK_TOKENS) -> None:
        self.budget_bytes = budget_bytes
        self.block_tokens = block_tokens
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self.bytes = 0
        self.stats = PrefixCacheStats()

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def _chain(self, tokens: list[int], count: int):
        """The keys of the first `count` whole blocks of `tokens`."""
        digest = b""
        for i in range(count):
            block = tokens[i * self.block_tokens:(i + 1) * self.block_tokens]
            digest = hashlib.sha256(digest + b"".join(t.to_bytes(4, "little") for t in block)).digest()
            yield digest

    def lookup(self, tokens: list[int], need_hidden: bool) -> list[Block]:
        """The cached blocks that begin `tokens`, longest chain first to last, leaving at least one
        token to prefill (its logits start the answer). With `need_hidden`, only blocks that hold
        the last layer's states."""
        self.stats.lookups += 1
        found, keys = [], []
        for key in self._chain(tokens, (len(tokens) - 1) // self.block_tokens):
            block = self.blocks.get(key)
            if block is None or (need_hidden and block.hidden is None):
                break
            found.append(block)
            keys.append(key)
        self._touch(keys)
        if found:
            self.stats.hits += 1
            self.stats.hit_tokens += len(found) * self.block_tokens
        return found

    def restore(self, blocks: list[Block], cache: KVCache) -> torch.Tensor | None:
        """Write the blocks into an empty cache's first positions; returns their last-layer states
        ([positions, hidden]) when every block has them."""
        for layer in range(cache.num_layers):
            cache.append(layer, torch.cat([b.keys[layer] for b in blocks], dim=1).transpose(0, 1),
                         torch.cat([b.values[layer] for b in blocks], dim=1).transpose(0, 1))
        if any(b.hidden is None for b in blocks):
            return None
        return torch.cat([b.hidden for b in blocks])

    def store(self, tokens: list[int], cache: KVCache, hidden: torch.Tensor | None = None) -> None:
        """Keep the whole blocks of `tokens` whose K/V the cache holds in every layer (positions
        before any deferred row), with their last-layer states where `hidden` has them (from
        position 0). A block already cached gains states it lacked and becomes most recent."""
        if not self.enabled:
            return
        written = min(min(cache.lengths), len(tokens))
        if cache.deferred.positions:
            written = min(written, cache.deferred.positions[0])
        count = written // self.block_tokens
        known = len(hidden) // self.block_tokens if hidden is not None else 0
        keys = list(self._chain(tokens, count))
        for i, key in enumerate(keys):
            rows = slice(i * self.block_tokens, (i + 1) * self.block_tokens)
            states = hidden[rows].clone() if i < known else None
            block = self.blocks.get(key)
            if block is not None:
                if block.hidden is None and states is not None:
                    block.hidden = states
                    self.bytes += states.nbytes
                continue
            block = Block(cache.keys[:, :, rows].clone(), cache.values[:, :, rows].clone(), states)
            self.blocks[key] = block
            self.bytes += block.nbytes
        self._touch(keys)
        self._evict()

    def _touch(self, chain: list[bytes]) -> None:
        """Mark a chain's blocks most recently used, its first block most of all: eviction then
        takes the ends of chains before their beginnings, which later blocks need."""
        for key in reversed(chain):
            self.blocks.move_to_end(key)

    def _evict(self) -> None:
        while self.bytes > self.budget_bytes and self.blocks:
            _, block = self.blocks.popitem(last=False)
            self.bytes -= block.nbytes
            self.stats.evictions += 1

    def clear(self) -> None:
        self.blocks.clear()
        self.bytes = 0
