"""A Katz-backoff n-gram model over token ids, trained offline on target outputs, and its drafter.

Smoothing: Katz backoff with absolute discounting. A continuation w seen after context h gets
(c(h, w) - D) / c(h); the mass D * types(h) / c(h) taken from the seen ones goes to the unseen
ones in proportion to the next-shorter context's probabilities, scaled by the backoff weight
alpha(h) so the distribution sums to 1. A context never seen backs off with weight 1. The base is
the unigram interpolated with the uniform distribution over the whole vocabulary, so every token
id keeps a non-zero probability. D is estimated per order as n1 / (n1 + 2 n2) (Ney et al.), where
nk is the number of n-grams seen exactly k times.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..artifact_header import ArtifactKind
from ..artifact_store import ArtifactLoader, register_artifact
from ..verification.draft import Draft
from .base import Proposer
from .registry import Drafting, SpecMethod, register

HEADER = ArtifactKind("specee-ngram", 1, "n-gram table", "specee train ngram", fingerprint_of="tokenizer")
# Keeps the estimated discount away from 0 (no mass left for unseen continuations) and from 1.
DISCOUNT_RANGE = (0.1, 0.9)
FALLBACK_DISCOUNT = 0.5  # when the data has no n-grams seen once or twice to estimate it from
BEST_MEMO = 1 << 16  # contexts whose best continuation `best` remembers
# Tables with at most this many contexts get every seen context's best continuation in a dict at
# first use (a few ms): a memo miss reads numpy arrays on caches a pass has just emptied, about
# 40 us, once or twice a pass.
SEEN_BEST_LIMIT = 1 << 18


@dataclass
class OrderTable:
    """Seen continuations of every context of one order, grouped by context, most probable first."""

    contexts: np.ndarray  # [n_contexts] int64 context keys, sorted for binary search
    starts: np.ndarray  # [n_contexts + 1] int64 offsets of each context's continuations
    tokens: np.ndarray  # [n_seen] int64 continuation token ids
    probs: np.ndarray  # [n_seen] float64 discounted probabilities
    backoff: np.ndarray  # [n_contexts] float64 alpha(h), the weight of the shorter context

    def find(self, key: int) -> int | None:
        row = int(np.searchsorted(self.contexts, key))
        return row if row < len(self.contexts) and self.contexts[row] == key else None


@dataclass
class Level:
    """One step of the backoff chain for a given context: its seen continuations and alpha."""

    tokens: np.ndarray  # [seen] int64, most probable first
    probs: np.ndarray  # [seen] float64
    backoff: float


@dataclass
class NgramModel:
    order: int
    vocab_size: int
    unigram: np.ndarray  # [vocab] float64, the base distribution
    tables: list[OrderTable]  # tables[k - 2] holds contexts of k - 1 tokens, for k = 2..order
    # Right guesses over the probabilities `best` gave them, on text the table was not trained on
    # (`specee train ngram` measures it); None where unmeasured.
    calibration: float | None = None

    def __post_init__(self) -> None:
        # The unigram is the last level of every backoff chain, with every token "seen".
        by_prob = np.argsort(-self.unigram, kind="stable")
        self._unigram_level = Level(by_prob, self.unigram[by_prob], backoff=0.0)
        self._best: dict[tuple[int, ...], tuple[int, float]] = {}
        self._seen_best: list[dict] | None = None  # built by `prepare` (seen_best)

    @staticmethod
    def train(
        sequences: Iterable[Sequence[int]], vocab_size: int, order: int = 3, progress: bool = True
    ) -> "NgramModel":
        if order < 1:
            raise ValueError(f"n-gram order must be at least 1, got {order}")
        if vocab_size**order >= 2**63:
            raise ValueError(
                f"order {order} over {vocab_size} tokens overflows the int64 n-gram keys"
            )
        keys: list[list[np.ndarray]] = [[] for _ in range(order)]  # keys[k - 1]: k-gram keys
        for sequence in tqdm(
            sequences, desc="n-gram counts", unit="seq", file=sys.stderr, disable=not progress
        ):
            ids = np.asarray(sequence, dtype=np.int64)  # [len]
            if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ValueError(f"token ids must lie in [0, {vocab_size})")
            for k in range(1, order + 1):
                keys[k - 1].append(_ngram_keys(ids, k, vocab_size))
        if not keys[0]:
            raise ValueError("no sequences to train the n-gram model on")
        grams = [np.unique(np.concatenate(k_keys), return_counts=True) for k_keys in keys]

        unigram = _unigram(*grams[0], vocab_size)
        tables: list[OrderTable] = []
        lower_keys, lower_probs = np.arange(vocab_size), unigram  # seen (k-1)-grams by key
        for k in range(2, order + 1):
            gram_keys, counts = grams[k - 1]
            table, probs_by_key = _order_table(
                gram_keys, counts, lower_keys, lower_probs, vocab_size, k
            )
            tables.append(table)
            lower_keys, lower_probs = gram_keys, probs_by_key
        return NgramModel(order, vocab_size, unigram, tables)

    def _levels(self, context: Sequence[int]) -> list[Level]:
        """The backoff chain for `context`, longest context first, ending with the unigram."""
        levels = []
        for k in range(min(self.order, len(context) + 1), 1, -1):
            table = self.tables[k - 2]
            row = table.find(_key(context[len(context) - (k - 1) :], self.vocab_size))
            if row is not None:
                seen = slice(table.starts[row], table.starts[row + 1])
                backoff = float(table.backoff[row])
                levels.append(Level(table.tokens[seen], table.probs[seen], backoff))
        levels.append(self._unigram_level)
        return levels

    def prob(self, context: Sequence[int], token: int) -> float:
        scale = 1.0
        for level in self._levels(context)[:-1]:
            hit = np.flatnonzero(level.tokens == token)
            if len(hit):
                return scale * float(level.probs[hit[0]])
            scale *= level.backoff
        return scale * float(self.unigram[token])

    def distribution(self, context: Sequence[int]) -> torch.Tensor:
        """P(token | context) for every token id: float64 [vocab], sums to 1."""
        dist = self.unigram.copy()  # [vocab]
        for level in reversed(self._levels(context)[:-1]):
            dist *= level.backoff
            dist[level.tokens] = level.probs
        return torch.from_numpy(dist)

    def best(self, context: Sequence[int]) -> tuple[int, float]:
        """The most probable next token and its probability."""
        return self.best_after(tuple(context[max(0, len(context) - (self.order - 1)) :]))

    def best_after(self, key: tuple[int, ...]) -> tuple[int, float]:
        """`best` for a context given as its last order - 1 tokens (a chain walked node by node keeps
        them as a tuple), remembered: chains drafted pass after pass ask for the same contexts again."""
        found = self._best.get(key)
        if found is None:
            if len(self._best) >= BEST_MEMO:
                self._best.clear()
            found = self._quick_best(key)
            if found is None:
                found = self._find_best(key)
            self._best[key] = found
        return found

    def prepare(self) -> "NgramModel":
        """Build what `best` reads (`seen_best`'s dicts, none for a table over SEEN_BEST_LIMIT), once.
        Loading does it, so that a server's first request does not wait for it (the default
        model's table: about 0.1 s)."""
        if self._seen_best is None:
            small = sum(len(table.contexts) for table in self.tables) <= SEEN_BEST_LIMIT
            self._seen_best = self.seen_best() if small else []
        return self

    @property
    def prepared(self) -> bool:
        return self._seen_best is not None

    def _quick_best(self, key: tuple[int, ...]) -> tuple[int, float] | None:
        """`best` from `seen_best`'s dicts (None for a table too large for them); a seen context
        whose shorter ones might win is answered by `_find_best` once, then from its dict."""
        self.prepare()
        if not self._seen_best:
            return None
        for k in range(min(self.order, len(key) + 1), 1, -1):
            ending = key[len(key) - (k - 1) :]
            by_context = self._seen_best[k - 2]
            found = by_context.get(ending, _UNSEEN)
            if found is None:
                found = by_context[ending] = self._find_best(ending)
            if found is not _UNSEEN:
                return found
        return self._unigram_best

    def seen_best(self) -> list[dict[tuple[int, ...], tuple[int, float] | None]]:
        """Per order k = 2..order, each seen context (k - 1 tokens) with its best continuation, as
        `_find_best` gives it where its first continuation wins outright; None where a shorter
        context's might beat it (`best` asks `_find_best`). Any longer context backs off to its
        longest seen ending with weight 1, so that ending's answer is its answer."""
        seen, reaches = [], []  # reaches: per order, the most any token gets after each seen context
        for k, table in enumerate(self.tables, start=2):
            first = table.starts[:-1]
            top, top_prob = table.tokens[first], table.probs[first]
            shorter = np.full(len(table.contexts), float(self._unigram_level.probs[0]))  # the next level's reach
            for j in range(2, k):  # longer shorter contexts overwrite: the longest seen one is the next level
                lower = self.tables[j - 2]
                if not len(lower.contexts):
                    continue
                keys = table.contexts % self.vocab_size ** (j - 1)
                rows = np.minimum(np.searchsorted(lower.contexts, keys), len(lower.contexts) - 1)
                hit = lower.contexts[rows] == keys
                shorter[hit] = reaches[j - 2][rows[hit]]
            wins = top_prob >= table.backoff * shorter
            reaches.append(np.maximum(top_prob, table.backoff * shorter))
            digits, rest = [], table.contexts
            for _ in range(k - 1):
                rest, digit = np.divmod(rest, self.vocab_size)
                digits.insert(0, digit.tolist())
            answers = [(token, prob) if win else None
                       for token, prob, win in zip(top.tolist(), top_prob.tolist(), wins.tolist())]
            seen.append(dict(zip(zip(*digits), answers)))
        return seen

    @functools.cached_property
    def _unigram_best(self) -> tuple[int, float]:
        return int(self._unigram_level.tokens[0]), float(self._unigram_level.probs[0])

    def _find_best(self, context: Sequence[int]) -> tuple[int, float]:
        """Usually the longest context's first continuation, which no shorter context can beat once
        its share is above the most they can give (their reach)."""
        levels = self._levels(context)
        first = levels[0]
        if len(levels) == 1 or first.probs[0] >= first.backoff * _reach(levels[1:]):
            return int(first.tokens[0]), float(first.probs[0])
        return self.top_k(context, 1)[0]

    def top_k(self, context: Sequence[int], k: int) -> list[tuple[int, float]]:
        """The k most probable next tokens, without building the whole distribution.

        A token's probability is set by the longest context it was seen after, so the answer is
        among the best k of each level once tokens seen at longer contexts are skipped; the walk
        stops once nothing in the shorter levels can beat the k-th found so far.
        """
        levels = self._levels(context)
        # reach[i]: the most any token can get from levels i.. on, before the longer alphas.
        reach = [float(levels[-1].probs[0])]
        for level in reversed(levels[:-1]):
            reach.insert(0, max(float(level.probs[0]), level.backoff * reach[0]))
        found: dict[int, float] = {}
        seen_longer = np.zeros(self.vocab_size, dtype=bool)  # [vocab] seen at a longer context
        num_seen_longer = 0
        scale = 1.0
        for i, level in enumerate(levels):
            # Among the first k + num_seen_longer entries at least k are new to this level.
            head = slice(0, k + num_seen_longer)
            new = ~seen_longer[level.tokens[head]]
            for token, prob in zip(level.tokens[head][new][:k], level.probs[head][new][:k]):
                found[int(token)] = scale * float(prob)
            if i + 1 == len(levels):
                break
            # Counted over this level's tokens, not the vocabulary: a sum over every id cost more
            # than the rest of the walk.
            num_seen_longer += int(np.count_nonzero(~seen_longer[level.tokens]))
            seen_longer[level.tokens] = True
            scale *= level.backoff
            if len(found) >= k and sorted(found.values())[-k] >= scale * reach[i + 1]:
                break
        return sorted(found.items(), key=lambda item: -item[1])[:k]

    def save(self, path: str | Path, fingerprint: str, info: dict | None = None) -> None:
        """One file: the artifact header (the fingerprint of the tokenizer it was trained for), then the table."""
        HEADER.save(path, fingerprint, {
            "order": self.order, "vocab_size": self.vocab_size, "unigram": torch.from_numpy(self.unigram),
            "tables": [{name: torch.from_numpy(array) for name, array in vars(table).items()} for table in self.tables],
            "calibration": self.calibration,
        }, info)

    @staticmethod
    def load(path: str | Path, fingerprint: str) -> "NgramModel":
        """Load a table trained for the tokenizer with `fingerprint`, prepared for `best`; anything
        else is a ValueError."""
        saved = HEADER.load(path, fingerprint)
        tables = [OrderTable(**{name: tensor.numpy() for name, tensor in table.items()}) for table in saved["tables"]]
        table = NgramModel(saved["order"], saved["vocab_size"], saved["unigram"].numpy(), tables, saved.get("calibration"))
        return table.prepare()


_UNSEEN = object()


def _reach(levels: list[Level]) -> float:
    """The most any token can get from a backoff chain, before the longer contexts' alphas."""
    reach = float(levels[-1].probs[0])
    for level in reversed(levels[:-1]):
        reach = max(float(level.probs[0]), level.backoff * reach)
    return reach


def _key(tokens: Sequence[int], vocab_size: int) -> int:
    key = 0
    for token in tokens:
        key = key * vocab_size + int(token)
    return key


def _ngram_keys(ids: np.ndarray, k: int, vocab_size: int) -> np.ndarray:
    """Every k-gram of `ids` as one int64, the first token most significant."""
    count = len(ids) - k + 1
    if count <= 0:
        return np.empty(0, dtype=np.int64)
    keys = np.zeros(count, dtype=np.int64)  # [count]
    for offset in range(k):
        keys = keys * vocab_size + ids[offset : offset + count]
    return keys


def _discount(counts: np.ndarray) -> float:
    once, twice = int((counts == 1).sum()), int((counts == 2).sum())
    if once + twice == 0:
        return FALLBACK_DISCOUNT
    return float(np.clip(once / (once + 2 * twice), *DISCOUNT_RANGE))


def _unigram(tokens: np.ndarray, counts: np.ndarray, vocab_size: int) -> np.ndarray:
    total = counts.sum()
    if total == 0:
        return np.full(vocab_size, 1.0 / vocab_size)
    discount = _discount(counts)
    dist = np.full(vocab_size, discount * len(tokens) / (total * vocab_size))  # [vocab]
    dist[tokens] += (counts - discount) / total
    return dist


def _order_table(
    gram_keys: np.ndarray,  # [n_seen] sorted k-gram keys
    counts: np.ndarray,  # [n_seen]
    lower_keys: np.ndarray,  # [n_lower] sorted (k-1)-gram keys
    lower_probs: np.ndarray,  # [n_lower] their probabilities
    vocab_size: int,
    k: int,
) -> tuple[OrderTable, np.ndarray]:
    """Discounted probabilities and backoff weights of one order; also returns probs by key."""
    context_of, token_of = np.divmod(gram_keys, vocab_size)
    contexts, starts, types = np.unique(context_of, return_index=True, return_counts=True)
    group = np.repeat(np.arange(len(contexts)), types)  # [n_seen] row of each k-gram's context
    context_counts = np.add.reduceat(counts, starts)  # [n_contexts]
    # A context already followed by every token has no unseen continuation to give mass to.
    discount = np.where(types == vocab_size, 0.0, _discount(counts))  # [n_contexts]
    probs = (counts - discount[group]) / context_counts[group]  # [n_seen]
    left_over = discount * types / context_counts  # [n_contexts]

    # Every k-gram's last k-1 tokens were seen too, so its backoff probability is a seen one.
    shorter = gram_keys % vocab_size ** (k - 1)
    shorter_probs = lower_probs[np.searchsorted(lower_keys, shorter)]  # [n_seen]
    unseen_shorter_mass = 1.0 - np.add.reduceat(shorter_probs, starts)  # [n_contexts]
    backoff = np.divide(
        left_over, unseen_shorter_mass, out=np.zeros_like(left_over), where=left_over > 0
    )

    # Sort each context's continuations by probability, most probable first, for top_k.
    by_prob = np.lexsort((-probs, group))
    ends = np.append(starts, len(gram_keys))
    table = OrderTable(contexts, ends, token_of[by_prob], probs[by_prob], backoff)
    return table, probs


@dataclass
class NgramProposer(Proposer):
    """Drafts from an n-gram model: a chain of argmaxes, or ranked guesses for trees."""

    drafts_trees = True
    model: NgramModel
    num_draft_tokens: int = 8
    # The last token drafted is the first whose table probability is below this (decided from
    # the table alone, before the token is drafted).
    confidence_threshold: float = 0.0

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        # Only the last order - 1 tokens matter, so long contexts are not copied per token.
        tail = list(context[max(0, len(context) - (self.model.order - 1)) :])
        tokens: list[int] = []
        for _ in range(min(max_tokens, self.num_draft_tokens)):
            best = self.model.top_k(tail + tokens, 1)
            if not best:
                break
            token, prob = best[0]
            tokens.append(token)
            if prob < self.confidence_threshold:
                break
        return Draft.chain(tokens)

    def candidates(self, context: list[int], k: int) -> list[tuple[int, float]]:
        return self.model.top_k(context[max(0, len(context) - (self.model.order - 1)) :], k)


def _ngram_method(config, artifacts) -> Drafting:
    table = artifacts.load("ngram", config.ngram_model)
    return Drafting(lambda: NgramProposer(table, config.num_draft_tokens, config.confidence_threshold))


register_artifact(ArtifactLoader("ngram", lambda path, store: NgramModel.load(path, store.tokenizer.fingerprint),
                                 "the ngram method needs --ngram-model FILE"))
register(SpecMethod("ngram", _ngram_method, scored=True, bench={"ngram": {}, "ngram-tree": {"tree": "auto"}}))
