"""Continuous batching on tiny models: several sequences' rows in one pass, each attending only to
its own cache, get the bits they get alone; generations sharing passes (dense, chains and trees,
greedy and seeded sampling, a late joiner, a chunked prefill) give exactly what they give alone;
a member prices its drafts by the rows the next pass will carry;
members with early exits join the shared pass layer by layer; a dropped or failing member
leaves the others untouched."""
import random

import pytest
import torch

from helpers import cpu_tier_params, threads, tiny_model
from specee.batch import Batch, run_together
from specee.drafters.prompt_lookup import PromptLookup
from specee.engine import Engine, Event
from specee.exits.candidates import Candidates
from specee.model.passes import PassRows, run_passes
from specee.strategies.base import Step, Strategy
from specee.strategies.early_exit import EarlyExit
from test_batch_invariance import kernel_model

PROMPTS = ["Repeat exactly: the red fox, the red fox, the red fox.", "Count from one to ten in words.",
           "the cat sat on the mat and looked at the dog.", "Hello there, name three colours: red, green"]
# Dense, a chain from a draft model, a sampled tree, and a stop string: one request each.
REQUESTS = [
    dict(max_tokens=30),
    dict(max_tokens=25, spec_method="draft", draft_model="self:2"),  # drafts all layers: accepted
    dict(max_tokens=30, spec_method="prompt-lookup", tree="auto", temperature=0.8, seed=3),
    dict(max_tokens=40, spec_method="prompt-lookup", stop=[" re"]),
]


@pytest.fixture(scope="module")
def engine(tiny_tokenizer):
    return Engine(tiny_model(seed=5, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=2), tiny_tokenizer)


def prefilled(model, prefix: list[int]):
    cache = model.new_cache(64)
    with torch.inference_mode():
        if prefix:
            model.run_pass(PassRows(torch.tensor(prefix), torch.arange(len(prefix)), cache))
    return cache


@pytest.mark.parametrize("quantization,tier", [("eager", None), ("none", None), ("int4 fp16 cache", None)] + [
    pytest.param("int4", tier.values[0], id=f"int4-{tier.id}", marks=tier.marks) for tier in cpu_tier_params()])
def test_several_sequences_in_one_pass_get_the_bits_they_get_alone(quantization, tier):
    half = quantization.endswith("fp16 cache")
    quantization = quantization.split()[0]
    model = tiny_model(seed=2) if quantization == "eager" else kernel_model(quantization, seed=2, tier=tier)
    if half:
        model.kv_cache_dtype = torch.float16
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    # A prefill chunk scoring its last row, a chain after a prefix, a tree (a mask) after another.
    shapes = [([], [5, 9, 2, 7, 7, 1, 3], None, 6), ([4, 8, 15], [16, 23], None, 0),
              ([42, 1, 2, 3, 4], [6, 7, 8, 9], tree, 0)]

    def parts():
        made = []
        for prefix, new, mask, logits_from in shapes:
            positions = torch.arange(len(prefix), len(prefix) + len(new))
            if mask is not None:
                positions = len(prefix) + mask.sum(1) - 1
            made.append(PassRows(torch.tensor(new), positions, prefilled(model, prefix), mask, logits_from))
        return made

    assert (model.fused_stack is not None) == (quantization == "int4")  # the integer formats run fused
    together = parts()
    with torch.inference_mode(), threads(3):  # on the kernels: one fused call, its rows split over threads
        batched = run_passes(model, together)
        alone_parts = parts()
        alone = [model.run_pass(part) for part in alone_parts]
    for (states, logits), (states_alone, logits_alone), part, part_alone, shape in zip(
            batched, alone, together, alone_parts, shapes):
        assert logits.shape[0] == len(shape[1]) - shape[3]
        assert torch.equal(states, states_alone) and torch.equal(logits, logits_alone)
        filled = part.cache.length
        assert filled == len(shape[0]) + len(shape[1]) == part_alone.cache.length  # its own cache only
        assert torch.equal(part.cache.keys[:, :, :filled], part_alone.cache.keys[:, :, :filled])
        assert part.cache.keys.dtype == (torch.float16 if half else torch.float32)


def run_batch(engine, generations, prefill_chunk=4, join_at=None):
    """Runs `generations` in one batch (those after index `join_at[0]` join at round `join_at[1]`);
    returns the rows of every pass and the events each member made."""
    batch = Batch(engine.model, prefill_chunk)
    first = generations if join_at is None else generations[: join_at[0]]
    members = {batch.add(g): i for i, g in enumerate(first)}
    events = {i: [] for i in range(len(generations))}
    rows, rounds = [], 0
    while batch.members or len(members) < len(generations):
        if join_at is not None and rounds == join_at[1]:
            members |= {batch.add(g): i for i, g in enumerate(generations) if i >= join_at[0]}
        for member, made in batch.advance():
            assert isinstance(made, Event), made
            events[members[member]].append(made)
        rows.append(batch.run_pass())
        rounds += 1
    return rows, events


def test_generations_sharing_passes_give_what_they_give_alone(engine):
    alone = [engine.generate(p, **r) for p, r in zip(PROMPTS, REQUESTS)]
    generations = [engine.stream(p, **r) for p, r in zip(PROMPTS, REQUESTS)]
    rows, events = run_batch(engine, generations, join_at=(3, 4))  # the last joins while the others decode
    for generation, result, request in zip(generations, alone, REQUESTS):
        assert generation.result.token_ids == result.token_ids
        assert (generation.result.text, generation.result.finish_reason) == (result.text, result.finish_reason)
        assert [t for e in events[generations.index(generation)] for t in e.token_ids] == result.token_ids
    assert alone[3].finish_reason == "stop" and alone[0].finish_reason == "length"
    assert sum(g.result.stats.draft_tokens_accepted for g in generations) > 0  # drafts were in play
    # The passes were shared: fewer than the generations ran alone (prefill chunks of 4 included).
    passes_alone = sum(-(-len(engine.encode(p)) // 4) + r.stats.target_passes for p, r in zip(PROMPTS, alone))
    assert len([r for r in rows if r]) < passes_alone


def test_run_together_gives_each_generation_its_result_alone_in_order(engine, monkeypatch):
    alone = [engine.generate(p, max_tokens=20) for p in PROMPTS]
    sharing = []  # members of the batch at each pass
    run_pass = Batch.run_pass
    monkeypatch.setattr(Batch, "run_pass", lambda self: sharing.append(len(self.members)) or run_pass(self))
    generations = [engine.stream(p, max_tokens=20) for p in PROMPTS + PROMPTS[:1]]
    results = run_together(engine.model, generations, width=2)  # five through two slots: joins as others end
    assert [r.token_ids for r in results] == [r.token_ids for r in alone + alone[:1]]
    assert [r.finish_reason for r in results] == [r.finish_reason for r in alone + alone[:1]]
    assert max(sharing) == 2  # two at a time, never more


@pytest.mark.parametrize("request_options", [dict(max_tokens=12, ignore_eos=True, temperature=0.9, seed=4),
                                             dict(max_tokens=12, ignore_eos=True, spec_method="prompt-lookup",
                                                  tree="auto", temperature=0.8, seed=9)])
def test_n_choices_share_one_prefill_and_each_samples_as_alone(engine, request_options):
    prompt = PROMPTS[0]
    leader = engine.stream(prompt, **request_options)
    generations = [leader] + leader.followers(2)
    rows, _ = run_batch(engine, generations)
    prompt_length = len(engine.encode(prompt))
    decode_rows = sum(g.result.stats.target_passes + g.result.stats.draft_nodes for g in generations)
    assert sum(rows) == prompt_length + decode_rows  # the prompt ran once
    for i, generation in enumerate(generations):  # choice i samples with seed + i, as alone
        alone = engine.generate(prompt, **(request_options | {"seed": request_options["seed"] + i}))
        assert generation.result.token_ids == alone.token_ids
    assert len({tuple(g.result.token_ids) for g in generations}) > 1


def test_followers_of_a_leader_dropped_before_its_prefill_prefill_alone(engine):
    leader = engine.stream(PROMPTS[1], max_tokens=6, ignore_eos=True)
    followers = leader.followers(2)
    batch = Batch(engine.model, 4)
    dropped = batch.add(leader)
    members = [batch.add(f) for f in followers]
    batch.drop(dropped)
    while batch.members:
        batch.advance()
        batch.run_pass()
    alone = engine.generate(PROMPTS[1], max_tokens=6, ignore_eos=True)
    assert [f.result.token_ids for f in followers] == [alone.token_ids] * 2 and len(members) == 2


def test_a_long_prompt_is_prefilled_in_chunks_beside_decoding(engine):
    long_prompt = " ".join(PROMPTS * 2)
    requests = [dict(max_tokens=60, ignore_eos=True, spec_method="none"), dict(max_tokens=5, spec_method="none")]
    alone = [engine.generate(p, **r) for p, r in zip([PROMPTS[1], long_prompt], requests)]
    generations = [engine.stream(p, **r) for p, r in zip([PROMPTS[1], long_prompt], requests)]
    join = -(-len(engine.encode(PROMPTS[1])) // 8) + 2  # once the first decodes
    rows, events = run_batch(engine, generations, prefill_chunk=8, join_at=(1, join))
    assert [g.result.token_ids for g in generations] == [r.token_ids for r in alone]
    # The first kept decoding, a token a pass, while the long prompt went in 8 tokens at a time.
    chunks = len(engine.encode(long_prompt)) // 8
    assert chunks > 3
    assert rows[join : join + chunks] == [8 + 1] * chunks
    assert len(events[0]) == 60 and max(rows) == 8 + 1


def test_members_price_drafts_by_the_rows_coming_not_a_prompt_just_run(engine):
    batch = Batch(engine.model)
    decoding = batch.add(engine.stream(PROMPTS[1], max_tokens=30, ignore_eos=True, spec_method="none"))
    for _ in range(3):  # its prompt, then two dense steps
        batch.advance()
        batch.run_pass()
    assert decoding.sharing_next() == (0, 0)
    prompt = " ".join(PROMPTS)
    joining = batch.add(engine.stream(prompt, max_tokens=5, spec_method="none"))
    batch.advance()
    assert joining.coming_rows() == len(engine.encode(prompt)) > 8  # parked: its prompt, counted exactly
    assert decoding.sharing_next() == (1, len(engine.encode(prompt)))
    batch.run_pass()
    # The pass just run carried the prompt; the next carries the newcomer's first dense step.
    assert decoding.sharing() == (1, len(engine.encode(prompt)))
    assert decoding.sharing_next() == (1, 1)
    batch.advance()
    assert decoding.sharing_next() == (1, 1) and joining.sharing_next() == (1, 1)


class Scripted(Strategy):
    """Yields fixed steps with no pass of the target (like a strategy with early exits, which runs
    its own passes), then fails if told to."""

    name = "scripted"

    def __init__(self, steps, fail: bool = False):
        self.steps, self.fail = steps, fail

    def decode(self, state):
        yield from self.steps
        if self.fail:
            raise RuntimeError("scripted failure")


def test_a_member_without_shared_passes_advances_and_a_failing_one_fails_alone(engine):
    steps = [Step([10 + i]) for i in range(6)]
    alone = engine.generate(PROMPTS[0], max_tokens=20)
    generations = [engine.stream(PROMPTS[0], max_tokens=20),
                   engine.stream(PROMPTS[1], max_tokens=6, ignore_eos=True, strategy=Scripted(steps)),
                   engine.stream(PROMPTS[2], max_tokens=20, ignore_eos=True, strategy=Scripted(steps[:2], fail=True))]
    batch = Batch(engine.model, prefill_chunk=None)
    members = [batch.add(g) for g in generations]
    failures, made = [], {m: [] for m in members}
    while batch.members:
        for member, outcome in batch.advance():
            (failures if isinstance(outcome, Exception) else made[member]).append((member, outcome))
        batch.run_pass()
    assert generations[0].result.token_ids == alone.token_ids
    assert generations[1].result.token_ids == [10 + i for i in range(6)]
    assert [(m, type(e).__name__) for m, e in failures] == [(members[2], "RuntimeError")]
    assert generations[2].result is None and len(made[members[2]]) == 2


def test_a_dropped_member_leaves_at_once_and_the_others_go_on(engine):
    dense = dict(spec_method="none")  # a row a pass
    alone = engine.generate(PROMPTS[0], max_tokens=24, **dense)
    generations = [engine.stream(PROMPTS[0], max_tokens=24, **dense),
                   engine.stream(PROMPTS[1], max_tokens=200, ignore_eos=True, **dense)]
    batch = Batch(engine.model, prefill_chunk=None)
    keep, drop = batch.add(generations[0]), batch.add(generations[1])
    for _ in range(4):
        batch.advance()
        batch.run_pass()
    batch.advance()
    assert drop.parked is not None  # dropped while its rows wait for the pass
    batch.drop(drop)
    assert drop.ended and batch.members == [keep]
    while batch.members:
        assert batch.run_pass() <= 1  # only the kept member's rows from now on
        batch.advance()
    assert generations[0].result.token_ids == alone.token_ids and generations[1].result is None


class SeededExit:
    """Asks to exit after a seeded random choice of layers; the full-head check always agrees (with
    the whole vocabulary as candidates, every check can pass)."""

    def __init__(self, layers: int, seed: int) -> None:
        self.layers, self.random = layers, random.Random(seed)

    def active(self):
        return [True] * (self.layers - 1)

    def fires(self, layer, features, probs, drafter_probs):
        return torch.tensor([self.random.random() < 0.4 for _ in range(len(features))])

    def confirms(self, logits, first, drafter_probs):
        return torch.ones(len(logits), dtype=torch.bool)

    def exited(self, layer):
        pass


def test_members_with_early_exits_join_the_shared_pass_layer_by_layer(tiny_tokenizer):
    layers = 5
    engine = Engine(tiny_model(seed=7, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=layers), tiny_tokenizer)
    vocab = list(range(tiny_tokenizer.vocab_size))

    def exits(seed, kv):
        return EarlyExit(Candidates(PromptLookup, vocab, len(vocab)), lambda: SeededExit(layers, seed), kv)

    requests = [(PROMPTS[0], dict(strategy=exits(0, "exact"))), (PROMPTS[1], dict()),
                (PROMPTS[2], dict(strategy=exits(1, "approx"))), (PROMPTS[3], dict(spec_method="prompt-lookup"))]
    alone = [engine.generate(p, max_tokens=20, ignore_eos=True, **r) for p, r in requests]
    generations = [engine.stream(p, max_tokens=20, ignore_eos=True, **r) for p, r in requests]
    rows, _ = run_batch(engine, generations, prefill_chunk=None)
    for generation, result in zip(generations, alone):
        assert generation.result.token_ids == result.token_ids
        assert generation.result.stats.exit_layers == result.stats.exit_layers
    assert min(alone[0].stats.exit_layers) < layers and min(alone[2].stats.exit_layers) < layers  # exits happened
    # The exit members' layers ran in the shared passes: fewer passes than all four made alone.
    assert len([r for r in rows if r]) < sum(r.stats.target_passes + 1 for r in alone)
