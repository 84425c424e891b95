"""Early exit inside speculative verification (SpecEE's hyper-tokens), for chains.

A chain [root, d1, .., dn] is one path: its verification pass may stop at a layer once the path
that would be accepted is settled there. After a scheduled layer, every row's exit policy is
asked at once (row j's candidates: the draft token d(j+1) first, then the exit drafter's guesses).
If the rows from the root on fire, the full head runs on them; the path is settled when, inside
that fired prefix, a row's argmax departs from the draft (or the chain ends) and that row's argmax
is one of its candidates. The accepted drafts and that argmax (the bonus token) are emitted, the
rows after them forgotten, and the kept rows' deeper layers handled as in plain decoding (exact:
caught up by the next pass; approx: K/V from the exit state). Greedy only: acceptance compares
argmaxes.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

import torch

from .base import DecodeState
from .early_exit import Candidates, ExitPass, ExitPolicy
from .speculative import DraftLength, Speculative


class SpeculativeExit:
    lossless = False

    def __init__(self, speculative: Speculative, candidates: Candidates, make_policy: Callable[[], ExitPolicy],
                 kv: str = "exact", name: str = "exit") -> None:
        if speculative.tree is not None:
            raise ValueError("exits inside speculative verification take chains: leave the tree option out")
        if speculative.shallow_layers:
            raise ValueError(f"exits inside speculative verification do not run with {speculative.name}, whose "
                             "drafter already runs the shallow layers")
        self.speculative = speculative
        self.candidates = candidates
        self.make_policy = make_policy
        self.kv = kv
        self.name = name

    def decode(self, state: DecodeState) -> Iterator[list[int]]:
        if not state.sampler.greedy:
            raise ValueError("exits inside speculative verification run greedy only (temperature 0)")
        model, cache, stats, tokens = state.model, state.cache, state.stats, state.tokens
        spec = self.speculative
        proposer, guesser = spec.make_proposer(), self.candidates.make_proposer()
        proposer.reset(tokens, state.sampler)
        guesser.reset(tokens, state.sampler)
        runner = ExitPass(model, cache, self.make_policy(), self.kv, stats)
        length = DraftLength(spec.num_draft_tokens, spec.num_draft_tokens, spec.adaptive)
        root = int(state.sampler.pick(state.logits)[0])
        tokens.append(root)
        yield [root]
        guesser.update(tokens, 0)
        while True:
            prefix = cache.lengths[0]
            began = time.perf_counter()
            chain = spec.draft(proposer, tokens, length.current).tokens
            drafted = time.perf_counter()
            picks = [self.candidates.pick(guesser, tokens + chain[:j], model.device,
                                          chain[j] if j < len(chain) else None) for j in range(len(chain) + 1)]
            candidates = torch.stack([ids for ids, _ in picks])  # [n + 1, K]
            drafter_probs = torch.tensor([prob for _, prob in picks])
            logits, layers = runner.run([tokens[-1], *chain], candidates, drafter_probs,
                                        self._settle(runner, chain, candidates))
            top = logits.argmax(-1).tolist()
            accepted = 0
            while accepted < min(len(chain), len(top) - 1) and top[accepted] == chain[accepted]:
                accepted += 1
            cache.truncate(prefix + 1 + accepted)  # an exit has already kept exactly these
            new = chain[:accepted] + [top[accepted]]
            tokens.extend(new)
            stats.record_pass(len(chain), accepted)
            stats.exit_layers.append(layers)
            stats.draft_s += drafted - began
            stats.verify_s += time.perf_counter() - drafted
            stats.draft_nodes += len(chain)
            stats.weight_bytes += proposer.take_bytes_read()
            length.update(len(chain), accepted)
            proposer.update(tokens, accepted)
            guesser.update(tokens, accepted)
            yield new

    @staticmethod
    def _settle(runner: ExitPass, chain: list[int], candidates: torch.Tensor):
        def settle(layer: int, states: torch.Tensor, fired: torch.Tensor):
            leading = int(fired.long().cumprod(0).sum())  # rows fired from the root on
            if not leading:
                return None
            top = runner.check(states[:leading])
            argmax = top.argmax(-1).tolist()
            row = 0
            while row < min(leading, len(chain)) and argmax[row] == chain[row]:
                row += 1
            # Settled: a fired row departs from the draft (or ends it) with a candidate argmax.
            if row >= leading or argmax[row] not in candidates[row].tolist():
                return None
            runner.stats.exit_checks_agreed += 1
            return row + 1, top[: row + 1]

        return settle
