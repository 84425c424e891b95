"""A server-wide suffix cache: the text of earlier requests (their prompts and answers), so a request
that says again what an earlier one said (an agent calling the same tool once more, a retried
question) drafts the continuation that followed its context's longest matching suffix there, as
suffix decoding (vLLM's `suffix` method) does for agents that repeat themselves.

The engine owns one and adds every lossless generation's prompt and answer when it ends; `auto`
asks it for an offer each pass. It holds at most `budget` tokens, evicting the oldest documents
first. A lookup reads only what the cache holds, so one history always gives the same drafts.
"""
from __future__ import annotations

import threading
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

# A match starts at an earlier occurrence of the context's last KEY_TOKENS tokens: shorter keys match
# unrelated text everywhere, and prompt lookup already copies short matches within the request.
KEY_TOKENS = 4
# Agreement longer than this counts as this long (it is read token by token, backwards).
MAX_MATCH = 32
# The match is the longest among this many latest occurrences of the key (ties: the latest).
RECENT_OCCURRENCES = 8
# ~40 bytes of index a token: 16 MB of tokens and index at the default.
DEFAULT_BUDGET_TOKENS = 1 << 18


class SuffixMatch(NamedTuple):
    length: int  # how many tokens before the continuation agree with the end of the context
    continuation: list[int]  # what followed there, up to the end of its document


@dataclass
class SuffixCacheStats:
    documents: int = 0  # documents added
    evicted: int = 0  # documents evicted for room
    lookups: int = 0
    hits: int = 0  # lookups that found a match with a continuation


class SuffixCache:
    def __init__(self, budget_tokens: int = DEFAULT_BUDGET_TOKENS) -> None:
        self.budget = budget_tokens
        # The documents held, oldest first, concatenated; tokens[0] is at position `base` of the
        # stream of every document ever added (positions stay valid while older text is evicted).
        self.tokens: list[int] = []
        self.base = 0
        self.starts: list[int] = []  # each held document's first position, oldest first
        # Each key (KEY_TOKENS tokens) -> the positions right after its occurrences, oldest first.
        self._follows: dict[tuple[int, ...], deque[int]] = {}
        self.stats = SuffixCacheStats()
        # The server's worker adds and looks up; a lock keeps a generation in another thread safe.
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.budget > KEY_TOKENS

    @property
    def held(self) -> int:
        return len(self.tokens)

    @property
    def end(self) -> int:
        return self.base + len(self.tokens)

    def add(self, document: list[int]) -> None:
        """Hold `document` (a prompt and its answer), evicting the oldest documents for room; one
        longer than the whole budget keeps its end."""
        document = list(document[-self.budget:]) if self.enabled else []
        if len(document) <= KEY_TOKENS:
            return
        with self._lock:
            self._evict(self.held + len(document) - self.budget)
            start = self.end
            self.starts.append(start)
            self.tokens.extend(document)
            for i in range(KEY_TOKENS, len(document)):  # a key at the very end has nothing after it
                self._follows.setdefault(tuple(document[i - KEY_TOKENS : i]), deque()).append(start + i)
            self.stats.documents += 1

    def _evict(self, tokens: int) -> None:
        """Drop the oldest documents until at least `tokens` tokens are freed."""
        freed = 0
        while freed < tokens and self.starts:
            start = self.starts.pop(0)
            stop = self.starts[0] if self.starts else self.end
            for i in range(start + KEY_TOKENS, stop):
                key = tuple(self.tokens[i - KEY_TOKENS - self.base : i - self.base])
                positions = self._follows[key]
                positions.popleft()  # the oldest occurrence of every key is in the oldest document
                if not positions:
                    del self._follows[key]
            freed += stop - start
            del self.tokens[: stop - start]
            self.base = stop
            self.stats.evicted += 1

    def clear(self) -> None:
        """Forget every document (a benchmark's runs must not draft from each other's answers)."""
        with self._lock:
            self.base, self.tokens, self.starts, self._follows = self.end, [], [], {}

    def lookup(self, context: list[int], limit: int) -> SuffixMatch | None:
        """The continuation (at most `limit` tokens) after the held occurrence whose text before it
        agrees longest with the end of `context`; None when the last KEY_TOKENS tokens never occurred."""
        if limit <= 0 or len(context) < KEY_TOKENS:
            return None
        with self._lock:
            self.stats.lookups += 1
            positions = self._follows.get(tuple(context[-KEY_TOKENS:]))
            if not positions:
                return None
            best, best_length = None, 0
            for i in range(len(positions) - 1, max(-1, len(positions) - 1 - RECENT_OCCURRENCES), -1):
                position = positions[i]
                first = self.starts[bisect_right(self.starts, position) - 1]  # its document's start
                length = KEY_TOKENS
                while (length < MAX_MATCH and position - length > first and length < len(context)
                       and self.tokens[position - length - 1 - self.base] == context[-length - 1]):
                    length += 1
                if length > best_length:
                    best, best_length = position, length
            following = bisect_right(self.starts, best)
            stop = self.starts[following] if following < len(self.starts) else self.end
            continuation = self.tokens[best - self.base : min(stop, best + limit) - self.base]
            self.stats.hits += 1
            return SuffixMatch(best_length, continuation)


# The chance that a continuation's next token is right, by how many tokens matched before it (from
# each listed length up): a prior shaped like prompt lookup's measured rates (copy_reliability.py),
# to be measured on the agent benchmark; each request calibrates it by what it accepts.
HIT_RATE_BY_MATCH = ((KEY_TOKENS, 0.5), (8, 0.7), (16, 0.85), (MAX_MATCH, 0.95))


def hit_rate(match_length: int) -> float:
    return [rate for shortest, rate in HIT_RATE_BY_MATCH if match_length >= shortest][-1]
