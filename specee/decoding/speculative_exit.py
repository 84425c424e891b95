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

import time
from typing import Callable, Iterator

import torch

from ..drafters.base import Proposer
from ..model.llama import Transformer
from ..stats import GenerationStats
from ..verification.acceptance import accept_greedy
from ..verification.draft import Draft
from ..verification.tree import TreeLayout
from .base import DecodeState
from .early_exit import Candidates, Check, ExitPass, ExitPolicy, PassResult, Settle
from .speculative import MAX_DRAFT_NODES, DraftLength, Speculative


class SpeculativeExit:
    lossless = False
    greedy_only = True  # acceptance compares argmaxes

    def __init__(self, speculative: Speculative, candidates: Candidates, make_policy: Callable[[], ExitPolicy],
                 kv: str = "exact", name: str = "exit") -> None:
        self.speculative = speculative
        self.shallow_layers = speculative.shallow_layers  # prefill hands the strategy these states
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
        if proposer.wants_features:
            proposer.observe(state.hidden)
        if spec.shallow_layers:
            proposer.share_target(cache, state.shallow)
        runner = ExitPass(model, cache, self.make_policy(), self.kv, stats)
        length = DraftLength(spec.num_draft_tokens, spec.num_draft_tokens, spec.adaptive)
        root = int(state.sampler.pick(state.logits)[0])
        tokens.append(root)
        yield [root]
        guesser.update(tokens, 0)
        while True:
            began = time.perf_counter()
            draft = spec.draft(proposer, tokens, length.current)
            drafted = time.perf_counter()
            layout = TreeLayout.of(draft)
            accepted, next_token, result = self.verify(runner, guesser, tokens, draft, layout)
            new = [draft.tokens[node] for node in accepted] + [next_token]
            if proposer.wants_features:  # the accepted path's states, where the pass stopped
                proposer.observe(result.hidden[[result.kept.index(row) for row in [0, *(1 + n for n in accepted)]]])
            tokens.extend(new)
            proposed = max(layout.depths, default=0)
            stats.record_pass(proposed, len(accepted))
            stats.exit_layers.append(result.layers)
            stats.draft_s += drafted - began
            stats.verify_s += time.perf_counter() - drafted
            stats.draft_nodes += len(draft)
            stats.weight_bytes += proposer.take_bytes_read()
            length.update(proposed, len(accepted))
            proposer.update(tokens, len(accepted))
            guesser.update(tokens, len(accepted))
            yield new

    def verify(self, runner: ExitPass, guesser: Proposer, context: list[int], draft: Draft, layout: TreeLayout
               ) -> tuple[list[int], int, PassResult]:
        """One verification pass with exits over [context[-1]] + `draft`, the cache rewound to the
        accepted path (`layout`: the draft's): (the accepted draft nodes, the next token, the pass)."""
        model = runner.model
        nodes = [-1, *range(len(draft))]  # the draft node of each row; the root is -1
        picks = [self.candidates.pick(guesser, context + [draft.tokens[n] for n in layout.path_to(node)], model.device,
                                      [draft.tokens[child] for child in layout.children(node)]) for node in nodes]
        candidates = torch.stack([ids for ids, _ in picks])  # [rows, K]
        drafter_probs = torch.tensor([prob for _, prob in picks])
        tree = None if draft.is_chain else layout.attention_mask().to(model.device)
        depths = None if draft.is_chain else [0, *layout.depths]
        position = runner.cache.lengths[self.shallow_layers or 0]
        result = runner.run([context[-1], *draft.tokens], candidates, drafter_probs,
                            self._settle(runner, layout, draft, candidates), tree, depths, draft.shallow,
                            self.shallow_layers or 0)
        if result.layers < runner.num_layers:  # exited: the pass kept the settled path and its bonus row
            return [row - 1 for row in result.kept[1:]], int(result.logits[-1].argmax()), result
        accepted, next_token = accept_greedy(draft, result.logits.argmax(-1))
        if draft.is_chain:
            runner.cache.truncate(position + 1 + len(accepted))
        else:
            runner.cache.keep(position, [position] + [position + 1 + node for node in accepted])
        return accepted, next_token, result

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

    def teacher_forced(self, model: Transformer, ids: list[int], prefix: int) -> tuple[torch.Tensor, GenerationStats]:
        """Score `ids` as `EarlyExit.teacher_forced` does. Each position's logits come from a
        verification pass with exits over [ids[t]] + the draft after ids[:t + 1]: the root row's,
        where the pass settled. The pass's other rows are then forgotten, as after a step that
        accepted no draft token."""
        if not 1 <= prefix < len(ids):
            raise ValueError(f"teacher forcing needs 1 <= prefix < {len(ids)}, got {prefix}")
        spec = self.speculative
        stats = GenerationStats()
        proposer, guesser = spec.make_proposer(), self.candidates.make_proposer()
        out = []
        with torch.inference_mode():
            cache = model.new_cache(len(ids) + MAX_DRAFT_NODES + 1)
            _, hidden, shallow = model.prefill(ids[:prefix], cache, spec.shallow_layers)
            proposer.reset(ids[:prefix], None)
            guesser.reset(ids[:prefix], None)
            if proposer.wants_features:
                proposer.observe(hidden)
            if spec.shallow_layers:
                proposer.share_target(cache, shallow)
            runner = ExitPass(model, cache, self.make_policy(), self.kv, stats)
            for t in range(prefix, len(ids) - 1):
                context = ids[: t + 1]
                if t > prefix:
                    proposer.update(context, 0)
                    guesser.update(context, 0)
                draft = spec.draft(proposer, context, spec.num_draft_tokens)
                _, _, result = self.verify(runner, guesser, context, draft, TreeLayout.of(draft))
                runner.rewind(t + 1)
                if proposer.wants_features:
                    proposer.observe(result.hidden[:1])
                stats.exit_layers.append(result.layers)
                out.append(result.logits[:1])
        return torch.cat(out), stats
