"""The prefix cache: K/V of earlier generations, so a prompt that starts like one seen before
(a conversation's next turn, an agent's next call, a shared system prompt) prefills only the rest.

Entries are blocks of BLOCK_TOKENS positions, each keyed by a hash of its tokens and of every
token before it (vLLM's hashed block chain: a block is found only after the same whole prefix, so
reuse is keyed by tokens alone). A block holds the K/V of every layer for its positions and, where
they were at hand, the hidden states after some depth that a drafter reads: the last layer's
(EAGLE, kept from prefill and from the accepted rows of verification) or its shared shallow
layers' (Kangaroo, kept from prefill). Blocks are copied into a generation's own cache, never
shared in place, so nothing a generation writes can change a cached block; they are evicted least
recently used under a byte budget. On the CPU kernels a row's bits do not depend on how the prompt
was cut into passes, so a reused prefix is bit-identical to a recomputed one.
"""
from __future__ import annotations

import hashlib
import os
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from .model.cache import KVCache

BLOCK_TOKENS = 16  # vLLM's default: at most 15 tokens of a reused prefix are prefilled again
# The default budget: K/V for this many tokens (a few conversations or agents' contexts), at most
# 1/MEMORY_SHARE of the memory available when the engine starts, and at most MAX_DEFAULT_BYTES. A
# fixed 1 GiB made a 135M model's server grow to 1.6 GB; its K/V for 8k tokens takes 360 MiB.
DEFAULT_TOKENS = 8192
MEMORY_SHARE = 8
MAX_DEFAULT_BYTES = 1 << 30


def default_budget_bytes(kv_bytes_per_token: int, available_bytes: int | None) -> int:
    """The prefix cache's budget when none is asked for, from the model's K/V bytes per token and
    the machine's available memory (None: unknown)."""
    budget = min(kv_bytes_per_token * DEFAULT_TOKENS, MAX_DEFAULT_BYTES)
    return budget if available_bytes is None else min(budget, available_bytes // MEMORY_SHARE)


def available_memory() -> int | None:
    """Bytes of memory available to new work: Linux's MemAvailable (free plus reclaimable caches),
    else the free physical pages, else None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass
class Block:
    keys: torch.Tensor  # [layers, kv_heads, BLOCK_TOKENS, head_dim]
    values: torch.Tensor
    states: dict[int, torch.Tensor]  # layers run -> [BLOCK_TOKENS, hidden] the states after them, where known

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + sum(s.nbytes for s in self.states.values())


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
        self.pending: Counter[bytes] = Counter()  # blocks generations are prefilling now, and how many
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

    def lookup(self, tokens: list[int], states_after: int | None = None) -> list[Block]:
        """The cached blocks that begin `tokens`, longest chain first to last, leaving at least one
        token to prefill (its logits start the answer). With `states_after`, only blocks that hold
        the states after that many layers."""
        self.stats.lookups += 1
        found, keys = [], []
        for key in self._chain(tokens, (len(tokens) - 1) // self.block_tokens):
            block = self.blocks.get(key)
            if block is None or (states_after is not None and states_after not in block.states):
                break
            found.append(block)
            keys.append(key)
        self._touch(keys)
        if found:
            self.stats.hits += 1
            self.stats.hit_tokens += len(found) * self.block_tokens
        return found

    def claim(self, tokens: list[int]) -> list[bytes]:
        """Mark the whole blocks of a prompt about to be prefilled that the cache lacks as being
        computed (until `release`), so that prompts beginning the same way can wait for them."""
        keys = [key for key in self._chain(tokens, len(tokens) // self.block_tokens) if key not in self.blocks]
        self.pending.update(keys)
        return keys

    def release(self, keys: list[bytes]) -> None:
        self.pending.subtract(keys)
        self.pending += Counter()  # drops the keys that reached zero

    def awaits(self, tokens: list[int]) -> bool:
        """Whether a prompt should wait for another generation's prefill: the blocks it would take
        from the cache stop at one being computed now, and such blocks make at least half of what
        it would prefill itself (waiting then costs no more than it saves, and the prefix is
        computed once however many requests arrive with it)."""
        if not self.pending:
            return False
        keys = list(self._chain(tokens, (len(tokens) - 1) // self.block_tokens))
        first = next((i for i, key in enumerate(keys) if key not in self.blocks), len(keys))
        coming = next((i for i, key in enumerate(keys[first:]) if key not in self.pending), len(keys) - first)
        return coming > 0 and 2 * coming * self.block_tokens >= len(tokens) - first * self.block_tokens

    def restore(self, blocks: list[Block], cache: KVCache, states_after: int | None = None) -> torch.Tensor | None:
        """Write the blocks into an empty cache's first positions; returns their states after
        `states_after` layers ([positions, hidden]) when asked for and every block has them."""
        for block in blocks:
            cache.write_prefix(block.keys, block.values)
        if states_after is None or any(states_after not in b.states for b in blocks):
            return None
        return torch.cat([b.states[states_after] for b in blocks])

    def store(self, tokens: list[int], cache: KVCache, states: dict[int, torch.Tensor] | None = None) -> None:
        """Keep the whole blocks of `tokens` whose K/V the cache holds in every layer (positions
        before any deferred row), with the states after each depth of `states` where they reach
        (each from position 0). A block already cached gains states it lacked and becomes most recent."""
        if not self.enabled:
            return
        written = min(min(cache.lengths), len(tokens))
        if cache.deferred.positions:
            written = min(written, cache.deferred.positions[0])
        count = written // self.block_tokens
        states = states or {}
        keys = list(self._chain(tokens, count))
        for i, key in enumerate(keys):
            rows = slice(i * self.block_tokens, (i + 1) * self.block_tokens)
            block = self.blocks.get(key)
            held = block.states if block is not None else {}
            # Copied only where the block lacks them: a conversation's every turn stores its whole history.
            new = {depth: s[rows].clone() for depth, s in states.items() if len(s) >= rows.stop and depth not in held}
            if block is not None:
                block.states |= new
                self.bytes += sum(s.nbytes for s in new.values())
                continue
            block = Block(cache.keys[:, :, rows].clone(), cache.values[:, :, rows].clone(), new)
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
