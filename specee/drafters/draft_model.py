"""Draft models: a smaller model with the target's tokenizer, or the target's own first L layers
(`self:L`: shallow layers + final norm + head, no training). Each keeps its own KV cache and
reuses it across steps: only tokens it has not yet seen are run."""
from __future__ import annotations

import torch

from ..model.cache import KVCache
from ..model.llama import Transformer
from ..sampling import Sampler
from .base import Draft


class DraftModel:
    def __init__(self, model: Transformer, num_layers: int | None = None, confidence_threshold: float = 0.0) -> None:
        total = model.config.num_hidden_layers
        self.num_layers = total if num_layers is None else num_layers
        if not 1 <= self.num_layers <= total:
            raise ValueError(f"a draft of {num_layers} layers: the model has 1..{total}")
        self.model = model
        self.layers = range(self.num_layers)
        # Stop drafting when the draft's own probability of its pick falls below this.
        self.confidence_threshold = confidence_threshold
        c = model.config
        head_bytes = (c.vocab_size + 1) * c.hidden_size * model.embed_tokens.weight.element_size()
        all_layer_bytes = model.weight_bytes - head_bytes
        self.pass_bytes = head_bytes + all_layer_bytes * self.num_layers // total
        self.bytes_read = 0
        self.cache: KVCache | None = None
        self.cached: list[int] = []  # the tokens whose K/V the draft cache holds, in order
        self.sampler: Sampler | None = None

    def reset(self, prompt: list[int], sampler: Sampler, max_len: int) -> None:
        c = self.model.config
        if self.cache is None or self.cache.max_len < max_len:
            dtype = torch.float32 if self.model.device.type == "cpu" else self.model.dtype
            self.cache = KVCache(self.num_layers, c.num_key_value_heads, c.head_dim, max_len, dtype, self.model.device)
        self.cache.reset()
        self.cached = []
        self.sampler = sampler

    def take_bytes_read(self) -> int:
        """Weight bytes read since the last call (for the bytes-per-token statistic)."""
        taken, self.bytes_read = self.bytes_read, 0
        return taken

    def logits_after(self, context: list[int], rows: int = 1) -> torch.Tensor:
        """The draft's logits after each of the last `rows` tokens of `context`: [rows, vocab].
        Rewinds its cache to the longest prefix it shares with `context`, then runs the rest."""
        common = 0
        limit = min(len(self.cached), len(context) - rows)
        while common < limit and self.cached[common] == context[common]:
            common += 1
        self.cache.truncate(common)
        new = context[common:]
        device = self.model.device
        h = self.model.hidden(torch.tensor(new, device=device), torch.arange(common, len(context), device=device),
                              self.cache, layers=self.layers)
        self.cached = list(context)
        self.bytes_read += self.pass_bytes
        return self.model.logits(self.model.norm(h[-rows:]))

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        """A chain: argmax drafts when greedy; draws from the processed distribution (recorded
        as q for rejection sampling) when sampling."""
        greedy = self.sampler is None or self.sampler.greedy
        tokens, dists = [], []
        ctx = list(context)
        for _ in range(max_tokens):
            logits = self.logits_after(ctx)[0]
            if greedy:
                probs = logits.float().softmax(-1)
                token = int(probs.argmax())
            else:
                probs = self.sampler.probs(logits[None])[0]
                token = int(torch.multinomial(probs, 1, generator=self.sampler.generator))
                dists.append(probs)
            if tokens and probs[token] < self.confidence_threshold:
                break
            tokens.append(token)
            ctx.append(token)
        if greedy:
            return Draft.chain(tokens)
        return Draft.chain(tokens, q=torch.stack(dists[: len(tokens)]), sampled=True)

    def candidates(self, context: list[int], k: int) -> list[tuple[int, float]]:
        probs = self.logits_after(context)[0].float().softmax(-1)
        top = probs.topk(k)
        return list(zip(top.indices.tolist(), top.values.tolist()))

    def update(self, context: list[int], num_accepted: int) -> None:
        """The cache is rewound lazily, at the next draft."""


class StagedDraft:
    """Staged speculative decoding's second stage: the draft model's own greedy decoding is
    itself speculative, verified against drafts from a cheaper proposer (prompt lookup or an
    n-gram table). Produces exactly the draft model's greedy chain, in fewer draft passes."""

    def __init__(self, draft: DraftModel, inner, inner_tokens: int = 4) -> None:
        self.draft = draft
        self.inner = inner
        self.inner_tokens = inner_tokens

    def reset(self, prompt: list[int], sampler: Sampler, max_len: int) -> None:
        # Drafts are deterministic (greedy); verification then treats them as one-hot.
        self.draft.reset(prompt, None, max_len)
        if hasattr(self.inner, "reset"):
            self.inner.reset(prompt)

    def take_bytes_read(self) -> int:
        return self.draft.take_bytes_read()

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        out: list[int] = []
        ctx = list(context)
        while len(out) < max_tokens:
            guess = self.inner.propose(ctx, min(self.inner_tokens, max_tokens - len(out) - 1)).tokens
            argmax = self.draft.logits_after(ctx + guess, rows=len(guess) + 1).argmax(-1).tolist()
            agreed = 0
            while agreed < len(guess) and guess[agreed] == argmax[agreed]:
                agreed += 1
            new = guess[:agreed] + [argmax[agreed]]
            out += new
            ctx += new
        return Draft.chain(out[:max_tokens])

    def update(self, context: list[int], num_accepted: int) -> None:
        self.inner.update(context, num_accepted)
