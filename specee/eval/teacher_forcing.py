"""What a lossy mode costs in quality, measured by teacher forcing on fixed text: exit fidelity
(the share of exited tokens equal to the full model's argmax at that position) and perplexity
against dense, over held-out reference text and over dense greedy continuations.

Each text is scored on its last QUALITY_TOKENS tokens; what comes before is prefilled by full
passes (as a prompt is), so the lossy mode runs one pass per scored token, as it decodes.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch

from ..engine import Engine
from ..model.llama import Transformer
from ..stats import GenerationStats
from ..strategies.early_exit import EarlyExit
from ..strategies.exit_pass import ExitPass
from ..strategies.speculative import MAX_DRAFT_NODES
from ..strategies.speculative_exit import ExitVerifier, SpeculativeExit
from ..verification.draft import Draft
from ..verification.tree import TreeLayout

QUALITY_TOKENS = 64
TEACHER_FORCED = (EarlyExit, SpeculativeExit)  # the lossy strategies `teacher_forced` scores


def teacher_forced(strategy: EarlyExit | SpeculativeExit, model: Transformer, ids: list[int], prefix: int
                   ) -> tuple[torch.Tensor, GenerationStats]:
    """Score `ids` as decoding with `strategy`'s exits would have had it emit them: ids[:prefix] are
    prefilled by full passes (a prompt), then ids[prefix:-1] are fed one by one with exits.
    Returns the logits predicting ids[prefix + 1:] ([len(ids) - 1 - prefix, vocab]) and the run's
    stats (exit layers)."""
    if not 1 <= prefix < len(ids):
        raise ValueError(f"teacher forcing needs 1 <= prefix < {len(ids)}, got {prefix}")
    stats = GenerationStats()
    contexts = [ids[: t + 1] for t in range(prefix, len(ids) - 1)]
    with torch.inference_mode():
        cache = model.new_cache(len(ids) + MAX_DRAFT_NODES + 1)
        _, hidden, shallow = model.prefill(ids[:prefix], cache, strategy.shallow_layers)
        runner = ExitPass(model, cache, strategy.make_policy(), strategy.kv, stats)
        logits = torch.cat(list(_passes(strategy, runner, contexts, hidden, shallow)))
    return logits, stats


def _passes(strategy: EarlyExit | SpeculativeExit, runner: ExitPass, contexts: list[list[int]],
            hidden: torch.Tensor, shallow: torch.Tensor | None) -> Iterator[torch.Tensor]:
    """Each context's logits for the next token [1, vocab] from one pass with exits over its last
    token and the draft after it (none for plain decoding), as decoding runs it: the root row's,
    where the pass settled. The pass's other rows are then forgotten, as after a step that
    accepted no draft token."""
    spec, prompt = strategy.speculative, contexts[0][:-1]
    proposer = spec.start_proposer(prompt, None, runner.cache, hidden, shallow) if spec else None
    verifier = ExitVerifier(strategy.candidates, runner, prompt, None, strategy.shallow_layers)
    for t, context in enumerate(contexts):
        verifier.update(context, 0)
        if proposer is not None and t:
            proposer.update(context, 0)
        draft = spec.draft(proposer, context, spec.num_draft_tokens) if spec else Draft.empty()
        verified = verifier.verify(context, draft, TreeLayout.of(draft))
        runner.cache.truncate(len(context))
        if proposer is not None and proposer.wants_features:
            proposer.observe(verified.hidden[:1])
        yield verified.logits[:1]


def dense_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    model = engine.model
    with torch.inference_mode():
        return model(torch.tensor(ids, device=model.device), torch.arange(len(ids), device=model.device),
                     model.new_cache(len(ids)))


def scored(ids: list[int], prefix: int | None = None) -> tuple[list[int], int]:
    """(the text cut to at most QUALITY_TOKENS scored tokens after `prefix`, the prefix): with no
    prefix, the last QUALITY_TOKENS tokens are scored."""
    if prefix is None:
        return ids, max(1, len(ids) - 1 - QUALITY_TOKENS)
    return ids[: prefix + 1 + QUALITY_TOKENS], prefix


def nll(logits: torch.Tensor, targets: list[int]) -> float:
    return torch.nn.functional.cross_entropy(logits.float(), torch.tensor(targets, device=logits.device),
                                             reduction="sum").item()


def dense_scores(engine: Engine, texts: list[tuple[list[int], int]]) -> list[tuple[float, torch.Tensor] | None]:
    """For each text ((ids, prefix) from `scored`): dense's summed NLL of the scored tokens and its
    argmax at each scored position; None for a text with nothing to score. Computed once per
    benchmark and shared by every lossy mode."""
    scores = []
    for ids, prefix in texts:
        if len(ids) - 1 - prefix < 1:
            scores.append(None)
            continue
        logits = dense_logits(engine, ids)[prefix:-1]
        scores.append((nll(logits, ids[prefix + 1:]), logits.argmax(-1)))
    return scores


def quality(engine: Engine, texts: list[tuple[list[int], int]], strategy=None,
            dense: list[tuple[float, torch.Tensor] | None] | None = None) -> dict:
    """Perplexity over `texts` ((ids, prefix) pairs from `scored`) under dense and, for a lossy
    strategy `teacher_forced` scores, under it, with how many tokens exited early and how many of
    those gave the full model's argmax. `dense`: the texts' `dense_scores`, if already computed."""
    dense = dense_scores(engine, texts) if dense is None else dense
    totals = {"dense": 0.0, "lossy": 0.0}
    count, exited, faithful = 0, 0, 0
    for (ids, prefix), scores in zip(texts, dense):
        if scores is None:
            continue
        dense_nll, dense_top = scores
        targets = ids[prefix + 1:]
        totals["dense"] += dense_nll
        count += len(targets)
        if strategy is not None:
            lossy, stats = teacher_forced(strategy, engine.model, ids, prefix)
            totals["lossy"] += nll(lossy, targets)
            exits = torch.tensor(stats.exit_layers, device=lossy.device) < engine.model.config.num_hidden_layers
            exited += int(exits.sum())
            faithful += int((lossy.argmax(-1) == dense_top)[exits].sum())
    if not count:
        return {}
    result = {"tokens": count, "ppl_dense": math.exp(totals["dense"] / count)}
    if strategy is not None:
        result.update(ppl=math.exp(totals["lossy"] / count), exited=exited, faithful=faithful)
    return result
