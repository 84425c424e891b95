"""Draft models: a smaller model with the target's tokenizer, or the target's own first L layers
(`self:L`: shallow layers + final norm + head, no training). Each keeps its own KV cache and
reuses it across steps: only tokens it has not yet seen are run."""
from __future__ import annotations

import torch

from ..artifact_store import ArtifactLoader, register_artifact
from ..loader import dtype_name, load_parts
from ..model.cache import KVCache
from ..model.llama import Transformer
from ..sampling import Sampler
from ..verification.draft import Draft
from .base import Proposer
from .ngram import NgramProposer
from .prompt_lookup import PromptLookup
from .registry import Drafting, SpecMethod, register
from .trained import drafter_cache


class DraftModel(Proposer):
    drafts_trees = True

    def __init__(self, model: Transformer, num_layers: int | None = None, confidence_threshold: float = 0.0,
                 vocab_size: int | None = None) -> None:
        total = model.config.num_hidden_layers
        self.num_layers = total if num_layers is None else num_layers
        if not 1 <= self.num_layers <= total:
            raise ValueError(f"a draft of {num_layers} layers: the model has 1..{total}")
        self.model = model
        self.layers = range(self.num_layers)
        # The last token drafted is the first at which the draft's largest probability is below
        # this: decided before the token is drawn, so sampling stays unbiased.
        self.confidence_threshold = confidence_threshold
        # The target's vocabulary size: a draft whose embedding is padded (or shorter) scores
        # exactly the target's token ids.
        self.vocab_size = vocab_size or model.config.vocab_size
        self.pass_bytes = model.head_bytes + model.layers_bytes(self.layers)
        self.cache: KVCache | None = None
        self.cached: list[int] = []  # the tokens whose K/V the draft cache holds, in order
        self.sampler: Sampler | None = None

    def reset(self, prompt: list[int], sampler: Sampler | None) -> None:
        self.cache = drafter_cache(self.model, layers=self.num_layers)
        self.cached = []
        self.sampler = sampler

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
        return fit_vocabulary(self.model.logits(self.model.norm(h[-rows:])), self.vocab_size)

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
            tokens.append(token)
            ctx.append(token)
            if self.confidence_threshold and probs.max() < self.confidence_threshold:
                break
        if greedy:
            return Draft.chain(tokens)
        return Draft.chain(tokens, q=torch.stack(dists), sampled=True)

    def candidates(self, context: list[int], k: int) -> list[tuple[int, float]]:
        probs = self.logits_after(context)[0].float().softmax(-1)
        top = probs.topk(k)
        return list(zip(top.indices.tolist(), top.values.tolist()))


def fit_vocabulary(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, V] -> [rows, vocab_size]: padded entries dropped, missing ones never chosen."""
    extra = vocab_size - logits.shape[-1]
    if extra <= 0:
        return logits[..., :vocab_size]
    return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))


class StagedDraft(Proposer):
    """Staged speculative decoding's second stage: the draft model's own greedy decoding is
    itself speculative, verified against drafts from a cheaper proposer (prompt lookup or an
    n-gram table). Produces exactly the draft model's greedy chain, in fewer draft passes."""

    def __init__(self, draft: DraftModel, inner, inner_tokens: int = 4) -> None:
        self.draft = draft
        self.inner = inner
        self.inner_tokens = inner_tokens

    def reset(self, prompt: list[int], sampler: Sampler | None) -> None:
        # Drafts are deterministic (greedy); verification then treats them as one-hot.
        self.draft.reset(prompt, None)
        self.inner.reset(prompt, None)

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


def draft_weights(artifacts, spec: str | None) -> tuple[Transformer, int | None]:
    """(draft weights, layers to use: None for all) for a path or "self:L"."""
    if spec is None:
        raise ValueError("the draft and staged methods need --draft-model PATH or --draft-model self:L")
    if spec.startswith("self:"):
        try:
            return artifacts.model, int(spec.removeprefix("self:"))
        except ValueError:
            raise ValueError(f"--draft-model {spec!r}: write self:L with L a number of layers") from None
    return artifacts.load("draft", spec), None


def _load_draft_model(path: str, artifacts) -> Transformer:
    """A separate draft model, loaded like the target, which must share its tokenizer."""
    target = artifacts.model
    parts = load_parts(path, dtype=dtype_name(target.dtype), device=target.device.type)
    if parts.tokenizer.vocab != artifacts.tokenizer.vocab:
        raise ValueError(f"draft model {path!r} does not share the target's tokenizer")
    return parts.model


def _draft_method(config, artifacts) -> Drafting:
    model, layers = draft_weights(artifacts, config.draft_model)
    vocab_size = artifacts.model.config.vocab_size
    return Drafting(lambda: DraftModel(model, layers, config.confidence_threshold, vocab_size))


def _staged_method(config, artifacts) -> Drafting:
    """The draft model sped up by a cheap proposer: the n-gram table when given, else prompt lookup."""
    model, layers = draft_weights(artifacts, config.draft_model)
    table = artifacts.load("ngram", config.ngram_model) if config.ngram_model else None
    vocab_size = artifacts.model.config.vocab_size
    return Drafting(lambda: StagedDraft(DraftModel(model, layers, vocab_size=vocab_size),
                                        NgramProposer(table) if table else PromptLookup()))


register_artifact(ArtifactLoader("draft", _load_draft_model, "the draft and staged methods need --draft-model PATH"))
# The target's first 6 layers as the draft model (alone, or sped up by prompt lookup).
register(SpecMethod("draft", _draft_method, scored=True, options=("draft_model",), bench={"draft-self": {"draft_model": "self:6"}}))
register(SpecMethod("staged", _staged_method, options=("draft_model",), bench={"staged": {"draft_model": "self:6"}}))
