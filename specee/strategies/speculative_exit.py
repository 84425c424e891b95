"""Early exit inside speculative verification (SpecEE's hyper-tokens), for chains and trees.

A verification pass runs over [root] + draft nodes; each root-to-leaf path is a hyper-token, and
the pass may stop at a layer once the path that would be accepted is settled there. After a
scheduled layer every row's exit policy is asked at once (a row's candidates: its draft children
first, then the exit drafter's guesses). The full head then runs on the rows whose whole path
from the root fired, and greedy acceptance walks them from the root: the path is settled when it
reaches a fired row whose argmax is none of its children (or that has none) and is one of its
candidates. That path's draft tokens and the argmax (the bonus token) are emitted, the other rows
are forgotten in every layer, and the kept rows' deeper layers are handled as in plain decoding
(exact: caught up by the next pass; approx: K/V from the exit state). Greedy only: acceptance
compares argmaxes.

A drafter that runs the target's shallow layers itself (Kangaroo) hands over its states, and the
pass starts above them; a drafter that reads the target's last states (EAGLE) is given the states
where the pass stopped, since the layers above never ran.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ..exits.candidates import Candidates
from ..exits.policy import ExitPolicy
from ..sampling import argmax
from ..verification.acceptance import accept_greedy
from ..verification.draft import Draft
from ..verification.tree import TreeLayout
from .base import DecodeState, Step, Strategy
from .exit_pass import Check, ExitPass, Settle
from .speculative import Speculative, Verified, keep_path


@dataclass(eq=False)
class SpeculativeExit(Strategy):
    speculative: Speculative
    candidates: Candidates
    make_policy: Callable[[], ExitPolicy]
    kv: str = "exact"
    name: str = "exit"
    lossless = False
    full_logits = False
    greedy_only = True  # acceptance compares argmaxes

    @property
    def reads_features(self) -> bool:
        return self.speculative.reads_features

    @property
    def shallow_layers(self) -> int | None:
        return self.speculative.shallow_layers  # prefill hands the strategy these states

    def decode(self, state: DecodeState) -> Iterator[Step]:
        """The speculative loop, its passes verified with exits."""
        runner = ExitPass(state.model, state.cache, self.make_policy(), self.kv, state.stats, passes=state.passes)
        return self.speculative.decode(state, ExitVerifier(self.candidates, runner, state.tokens, state.sampler,
                                                           self.shallow_layers))


class ExitVerifier:
    """Verification passes with exits for one generation: each row's candidates from its own
    guesser, the pass run by `runner` (above the `shallow_layers` a drafter ran itself)."""

    def __init__(self, candidates: Candidates, runner: ExitPass, prompt: list[int], sampler,
                 shallow_layers: int | None = None) -> None:
        self.candidates, self.shallow_layers = candidates, shallow_layers or 0
        self.runner = runner
        self.guesser = candidates.make_proposer()
        self.guesser.reset(prompt, sampler)

    def update(self, tokens: list[int], num_accepted: int) -> None:
        self.guesser.update(tokens, num_accepted)

    def verify(self, context: list[int], draft: Draft, layout: TreeLayout) -> Verified:
        """One verification pass with exits over [context[-1]] + `draft`, the cache rewound to the
        accepted path (`layout`: the draft's)."""
        runner, model = self.runner, self.runner.model
        nodes = [-1, *range(len(draft))]  # the draft node of each row; the root is -1
        picks = [self.candidates.pick(self.guesser, context + [draft.tokens[n] for n in layout.path_to(node)],
                                      model.device, [draft.tokens[child] for child in layout.children(node)])
                 for node in nodes]
        candidates = torch.stack([ids for ids, _ in picks])  # [rows, K]
        drafter_probs = torch.tensor([prob for _, prob in picks])
        tree = None if draft.is_chain else layout.attention_mask().to(model.device)
        depths = None if draft.is_chain else [0, *layout.depths]
        position = runner.cache.lengths[self.shallow_layers]
        result = runner.run([context[-1], *draft.tokens], candidates, drafter_probs,
                            self._settle(runner, layout, draft, candidates), tree, depths, draft.shallow,
                            self.shallow_layers)
        runner.stats.exit_layers.append(result.layers)
        if result.layers < runner.num_layers:  # exited: the pass kept the settled path and its bonus row
            accepted, next_token = [row - 1 for row in result.kept[1:]], int(result.logits[-1].argmax())
        else:
            accepted, next_token = accept_greedy(draft, argmax(result.logits))
            keep_path(runner.cache, position, draft, accepted)
        return Verified(accepted, next_token, result.logits, result.hidden,
                        [result.kept.index(row) for row in [0, *(1 + node for node in accepted)]],
                        result.layers if result.layers < runner.num_layers else None)

    @staticmethod
    def _settle(runner: ExitPass, layout: TreeLayout, draft: Draft, candidates: torch.Tensor) -> Settle:
        """Settled at a layer when greedy acceptance, walked from the root over the rows whose
        whole path fired (and whose exit the check confirmed), ends at a row whose argmax is none
        of its children and is one of its candidates."""
        parent_rows = [-1] + [parent + 1 for parent in layout.parents]
        child_rows = [{draft.tokens[child]: child + 1 for child in layout.children(row - 1)}
                      for row in range(len(draft) + 1)]

        def settle(layer: int, fired: torch.Tensor, check: Check):
            reached: list[int] = []  # rows whose whole path from the root fired (parents come first)
            inside: set[int] = set()
            for row, fire in enumerate(fired.tolist()):
                if fire and (row == 0 or parent_rows[row] in inside):
                    reached.append(row)
                    inside.add(row)
            if not reached:
                return None
            top, confirmed = check(reached)
            argmax = {row: token for row, token, ok in zip(reached, top.argmax(-1).tolist(), confirmed) if ok}
            if 0 not in argmax:
                return None
            path = [0]
            while (child := child_rows[path[-1]].get(argmax[path[-1]])) is not None:
                if child not in argmax:
                    return None  # the accepted path goes on through a row whose exit did not stand
                path.append(child)
            # Settled: the path ends at a fired row whose argmax leaves the draft and is a candidate.
            if argmax[path[-1]] not in candidates[path[-1]].tolist():
                return None
            runner.stats.exit_checks_agreed += 1
            index = {row: i for i, row in enumerate(reached)}
            return path, top[[index[row] for row in path]]

        return settle
