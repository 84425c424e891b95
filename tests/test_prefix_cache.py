"""The prefix cache: a prompt that begins like an earlier prompt or answer takes those blocks' K/V
and prefills only the rest, with the same tokens as without the cache (the kernels give a row the
same bits however the prompt is cut), for every strategy; bounded by its budget, least recently
used first; keyed by tokens only; only whole, committed positions are kept."""
import random

import pytest
import torch

from helpers import tiny_model
from specee.engine import Engine
from specee.model.passes import PassRows
from specee.prefix_cache import BLOCK_TOKENS as BLOCK
from specee.prefix_cache import PrefixCache
from test_batch import run_batch
from test_batch_invariance import kernel_model
from test_eagle import eagle_strategy
from test_eagle import random_artifact as eagle_artifact
from test_kangaroo import kangaroo_strategy
from test_kangaroo import random_artifact as kangaroo_artifact

VOCAB = 160  # kernel_model's


@pytest.fixture(scope="module")
def engine(tiny_tokenizer):
    return Engine(kernel_model("none", seed=8), tiny_tokenizer, prefix_cache_mb=64)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


REQUESTS = {
    "dense": dict(max_tokens=40, ignore_eos=True),
    "seeded sampling": dict(max_tokens=40, ignore_eos=True, temperature=0.9, seed=5),
    "prompt-lookup tree": dict(max_tokens=40, ignore_eos=True, spec_method="prompt-lookup", tree="auto"),
    "draft chain": dict(max_tokens=40, ignore_eos=True, spec_method="draft", draft_model="self:1"),
}


@pytest.mark.parametrize("name", REQUESTS)
def test_a_conversations_next_turn_reuses_its_history_with_the_same_tokens(engine, name):
    options = REQUESTS[name]
    engine.prefix_cache.clear()
    first = prompt(1, 70)
    turn1 = engine.generate(first, **options)
    assert turn1.stats.cached_tokens == 0
    again = engine.generate(first, **options)
    assert again.stats.cached_tokens == 64 and again.token_ids == turn1.token_ids
    history = first + turn1.token_ids + prompt(2, 9)  # the answer and a new message
    cold = engine.generate(history, prefix_cache=False, **options)
    warm = engine.generate(history, **options)
    # The prompt's blocks and the answer's (all but its last token was run) are reused.
    assert warm.stats.cached_tokens == (len(first) + len(turn1.token_ids) - 1) // BLOCK * BLOCK >= 96
    assert cold.stats.cached_tokens == 0
    assert warm.token_ids == cold.token_ids and warm.finish_reason == cold.finish_reason


@pytest.mark.parametrize("name", ["eagle", "kangaroo"])
def test_drafters_that_read_states_reuse_the_blocks_that_hold_them(engine, name):
    """EAGLE reads the last layer's states: a block keeps them from prefill and from the accepted
    rows of verification, so a next turn reuses the prompt and the answer. Kangaroo reads the states
    after its shared layers, which only its prefill has: it reuses the earlier prompt's blocks.
    The cached states are the bits a prefill of the whole history computes."""
    model = engine.model
    strategy = (eagle_strategy(model, eagle_artifact(model)) if name == "eagle"
                else kangaroo_strategy(model, kangaroo_artifact(model)))
    options = dict(strategy=strategy, max_tokens=40, ignore_eos=True)
    engine.prefix_cache.clear()
    first = prompt(11, 70)
    turn1 = engine.generate(first, **options)
    history = first + turn1.token_ids + prompt(12, 9)
    cold = engine.generate(history, prefix_cache=False, **options)
    warm = engine.generate(history, **options)
    ran = len(first) + len(turn1.token_ids) - 1  # the answer's last token was never run
    assert warm.stats.cached_tokens == (ran if name == "eagle" else len(first)) // BLOCK * BLOCK
    assert warm.token_ids == cold.token_ids
    depth = strategy.shallow_layers or model.config.num_hidden_layers
    with torch.inference_mode():
        _, last, shallow = model.prefill(history, model.new_cache(len(history)), strategy.shallow_layers)
        blocks = engine.prefix_cache.lookup(history, depth)
        cached = engine.prefix_cache.restore(blocks, model.new_cache(len(history)), depth)
    computed = shallow if strategy.shallow_layers else last
    assert torch.equal(cached, computed[:len(cached)]) and not torch.equal(cached, computed[1:len(cached) + 1])


def test_blocks_are_found_only_with_the_states_asked_for(engine):
    model = engine.model
    tokens = prompt(13, 2 * BLOCK)
    with torch.inference_mode():
        kv = model.new_cache(80)
        model.run_pass(PassRows(torch.tensor(tokens), torch.arange(2 * BLOCK), kv))
    shallow, last = torch.randn(2 * BLOCK, 8), torch.randn(BLOCK + 3, 8)  # the last layer's reach only the first block
    cache = PrefixCache(1 << 30)
    cache.store(tokens, kv, {1: shallow, 4: last})
    assert len(cache.lookup(tokens + [0])) == 2 and len(cache.lookup(tokens + [0], states_after=1)) == 2
    assert len(cache.lookup(tokens + [0], states_after=4)) == 1 and cache.lookup(tokens + [0], states_after=3) == []
    restored = model.new_cache(80)
    assert torch.equal(cache.restore(cache.lookup(tokens + [0], states_after=1), restored, 1), shallow)
    assert cache.restore(cache.lookup(tokens + [0]), model.new_cache(80), 4) is None  # the second block lacks them
    held = cache.bytes
    cache.store(tokens, kv, {4: torch.randn(2 * BLOCK, 8)})  # a later generation brings the missing states
    assert len(cache.lookup(tokens + [0], states_after=4)) == 2 and cache.bytes == held + BLOCK * 8 * 4


def test_keys_are_whole_prefixes_of_tokens(engine):
    engine.prefix_cache.clear()
    tokens = prompt(3, 100)
    engine.generate(tokens, max_tokens=2, ignore_eos=True)
    assert engine.generate(tokens, max_tokens=1).stats.cached_tokens == 96
    changed_first = [(tokens[0] + 1) % VOCAB] + tokens[1:]  # the same blocks after a different start
    assert engine.generate(changed_first, max_tokens=1, prefix_cache=False).stats.cached_tokens == 0
    assert engine.generate(changed_first, max_tokens=1).stats.cached_tokens == 0
    changed_second_block = tokens[:40] + [(tokens[40] + 1) % VOCAB] + tokens[41:]
    assert engine.generate(changed_second_block, max_tokens=1).stats.cached_tokens == 32


def test_eviction_is_least_recently_used_within_the_budget(engine):
    model = engine.model
    cache = PrefixCache(budget_bytes=0)
    kv = model.new_cache(4 * BLOCK)
    tokens = prompt(4, 4 * BLOCK)
    with torch.inference_mode():
        model.run_pass(PassRows(torch.tensor(tokens), torch.arange(4 * BLOCK), kv))
    one_block = PrefixCache(1 << 40)
    one_block.store(tokens[:BLOCK], kv)
    block_bytes = one_block.bytes
    cache.budget_bytes = 3 * block_bytes  # room for three blocks
    cache.store(tokens, kv)  # four: the chain's last is evicted first
    assert len(cache.blocks) == 3 and cache.bytes <= cache.budget_bytes and cache.stats.evictions == 1
    assert len(cache.lookup(tokens + [0], states_after=None)) == 3
    other = prompt(5, 2 * BLOCK)
    with torch.inference_mode():
        kv2 = model.new_cache(2 * BLOCK)
        model.run_pass(PassRows(torch.tensor(other), torch.arange(2 * BLOCK), kv2))
    cache.store(other, kv2)  # two more blocks: the first chain loses its end again, never its start
    assert cache.bytes <= cache.budget_bytes
    assert len(cache.lookup(tokens + [0], states_after=None)) == 1
    assert len(cache.lookup(other + [0], states_after=None)) == 2


def test_a_restored_prefix_is_bit_identical_to_its_prefill(engine):
    model = engine.model
    tokens = prompt(6, 64)
    cache = PrefixCache(1 << 30)
    with torch.inference_mode():
        full = model.new_cache(80)
        model.run_pass(PassRows(torch.tensor(tokens), torch.arange(64), full))
        cache.store(tokens, full)
        restored = model.new_cache(80)
        cache.restore(cache.lookup(tokens + [1], states_after=None), restored)
    assert restored.lengths == [64] * model.config.num_hidden_layers
    assert torch.equal(restored.keys[:, :, :64], full.keys[:, :, :64])
    assert torch.equal(restored.values[:, :, :64], full.values[:, :, :64])


def test_only_positions_every_layer_holds_and_committed_tokens_are_kept(engine):
    model = engine.model
    tokens = prompt(7, 96)
    with torch.inference_mode():
        kv = model.new_cache(128)
        model.run_pass(PassRows(torch.tensor(tokens), torch.arange(96), kv))
    kv.lengths[1] = 40  # a layer that lags (an early exit's skipped layers)
    cache = PrefixCache(1 << 30)
    cache.store(tokens, kv)
    assert len(cache.blocks) == 40 // BLOCK
    kv.lengths[1] = 96
    kv.deferred.positions, kv.deferred.levels = [70], [1]  # a row waiting for its deeper layers
    cache.store(tokens, kv)
    assert len(cache.blocks) == 70 // BLOCK
    cache.store(tokens[:50], kv)  # tokens not (yet) committed are not keys of anything
    assert len(cache.blocks) == 70 // BLOCK


def test_a_cancelled_generation_leaves_only_what_it_committed(engine):
    engine.prefix_cache.clear()
    tokens = prompt(8, 40)
    stream = engine.stream(tokens, max_tokens=60, ignore_eos=True, spec_method="prompt-lookup")
    events = iter(stream)
    committed = list(tokens)
    for _ in range(10):
        committed += next(events).token_ids
    events.close()  # the client went away
    blocks = len(engine.prefix_cache.blocks)
    assert blocks == (len(committed) - 1) // BLOCK
    alone = engine.generate(committed + [1], max_tokens=1, prefix_cache=False)
    reused = engine.generate(committed + [1], max_tokens=1)
    assert reused.stats.cached_tokens == blocks * BLOCK and reused.token_ids == alone.token_ids


def test_a_running_generations_prompt_is_shared_before_it_ends(engine):
    engine.prefix_cache.clear()
    system = prompt(16, 96)
    running = iter(engine.stream(system + prompt(17, 5), max_tokens=30, ignore_eos=True))
    next(running)  # prefilled, decoding
    other = system + prompt(18, 7)
    shared = engine.generate(other, max_tokens=8, ignore_eos=True)
    assert shared.stats.cached_tokens == 96
    assert len(list(running)) > 1  # the first was still running
    assert shared.token_ids == engine.generate(other, max_tokens=8, ignore_eos=True, prefix_cache=False).token_ids


def test_a_tiny_budget_evicts_and_answers_stay_the_same(tiny_tokenizer):
    small = Engine(kernel_model("none", seed=8), tiny_tokenizer, prefix_cache_mb=0)
    small.prefix_cache.budget_bytes = 3 * block_bytes(small.model)  # three blocks for a longer conversation
    history = prompt(19, 40)
    for turn in range(4):
        warm = small.generate(history, max_tokens=30, ignore_eos=True)
        cold = small.generate(history, max_tokens=30, ignore_eos=True, prefix_cache=False)
        assert warm.token_ids == cold.token_ids and small.prefix_cache.bytes <= small.prefix_cache.budget_bytes
        history = history + warm.token_ids + prompt(20 + turn, 6)
    assert small.prefix_cache.stats.evictions > 0 and small.prefix_cache.stats.hits > 0


def block_bytes(model) -> int:
    one = PrefixCache(1 << 40)
    with torch.inference_mode():
        kv = model.new_cache(BLOCK)
        model.run_pass(PassRows(torch.arange(BLOCK), torch.arange(BLOCK), kv))
    one.store(list(range(BLOCK)), kv)
    return one.bytes


def test_concurrent_prompts_with_one_prefix_prefill_it_once(engine):
    """Requests arriving together with one system prompt: the first prefills it, the others wait
    for its blocks (a round at a time) and prefill only their own messages, answering as alone."""
    engine.prefix_cache.clear()
    system = prompt(21, 6 * BLOCK)
    prompts = [system + prompt(22 + i, 5) for i in range(3)]
    generations = [engine.stream(p, max_tokens=6, ignore_eos=True) for p in prompts]
    rows, _ = run_batch(engine, generations, prefill_chunk=32)
    assert [g.result.stats.cached_tokens for g in generations] == [0, 6 * BLOCK, 6 * BLOCK]
    decoded = sum(g.result.stats.target_passes + g.result.stats.draft_nodes for g in generations)
    assert sum(rows) == len(prompts[0]) + 5 + 5 + decoded  # the system prompt ran once
    for p, g in zip(prompts, generations):
        assert g.result.token_ids == engine.generate(p, max_tokens=6, ignore_eos=True, prefix_cache=False).token_ids
    assert not engine.prefix_cache.pending


def test_a_prompt_waits_only_for_blocks_that_make_half_its_prefill():
    cache = PrefixCache(1 << 20)
    shared = prompt(30, 4 * BLOCK)
    claimed = cache.claim(shared + prompt(31, 3))
    assert len(claimed) == 4
    assert cache.awaits(shared + prompt(32, 10))  # four blocks coming of 4 * BLOCK + 10 tokens
    assert not cache.awaits(shared[:BLOCK] + prompt(33, 4 * BLOCK))  # one of five: it prefills alone
    assert not cache.awaits(prompt(34, 5 * BLOCK))
    cache.release(claimed)
    assert not cache.pending and not cache.awaits(shared + prompt(32, 10))


class FailingPasses:
    """The model's passes, until the `fail_at`-th, which raises (a batch that drops its member)."""

    def __init__(self, model, fail_at: int) -> None:
        self.model, self.fail_at, self.calls = model, fail_at, 0

    def run_pass(self, part):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("the request was cancelled")
        return self.model.run_pass(part)

    def run_layer(self, rows):
        return self.model.run_layer(rows)


def test_a_generation_cancelled_mid_prefill_leaves_the_cache_as_it_was(engine):
    engine.prefix_cache.clear()
    shared = prompt(14, 70)
    engine.generate(shared, max_tokens=1)
    before = set(engine.prefix_cache.blocks)
    longer = shared + prompt(15, 100)
    passes = FailingPasses(engine.model, fail_at=3)  # 64 cached, two chunks of 32 prefilled, then fails
    with pytest.raises(RuntimeError, match="cancelled"):
        list(engine.stream(longer, max_tokens=5).events(passes, prefill_chunk=32))
    assert passes.calls == 3 and set(engine.prefix_cache.blocks) == before  # nothing of the half prefill
    assert not engine.prefix_cache.pending  # and nobody waits for it
    warm = engine.generate(longer, max_tokens=5, ignore_eos=True)
    assert warm.stats.cached_tokens == 64
    assert warm.token_ids == engine.generate(longer, max_tokens=5, ignore_eos=True, prefix_cache=False).token_ids


def test_off_when_asked_and_where_kernels_are_not_batch_invariant(tiny_tokenizer):
    eager = Engine(tiny_model(seed=1, vocab_size=tiny_tokenizer.vocab_size), tiny_tokenizer)
    assert not eager.prefix_cache.enabled  # PyTorch's own kernels: bits depend on the pass's shape
    off = Engine(kernel_model("none", seed=8), tiny_tokenizer, prefix_cache_mb=0)
    tokens = prompt(9, 70)
    off.generate(tokens, max_tokens=1)
    assert not off.prefix_cache.blocks and off.generate(tokens, max_tokens=1).stats.cached_tokens == 0


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["none", "int8", "int4", "gguf"])
def test_every_method_on_the_default_model_answers_the_same_with_the_cache(quantization):
    """The real model in every CPU format: a second turn resent with its history gets the same
    tokens from every method (early exits included; in the default format gguf, every drafter)
    with the cache as without, and reuses the history's blocks."""
    import specee

    engine = specee.load(quantization=quantization)
    history = [{"role": "system", "content": "You answer in one short paragraph. " * 6},
               {"role": "user", "content": "Why is the sky blue?"}]
    drafters = ("prompt-lookup", "ngram", "hybrid", "eagle", "eagle-copy", "kangaroo") if quantization == "gguf" \
        else ("hybrid", "eagle", "kangaroo")  # each kind of state a strategy keeps, in every format
    methods = [{"spec_method": m} for m in (None, *drafters)] + [{"exit": "specee"}]
    if quantization == "gguf":
        methods += [{"spec_method": m, "draft_model": "self:4"} for m in ("draft", "staged")]
    for method in methods:
        engine.prefix_cache.clear()
        first = engine.generate(history, max_tokens=40, **method)
        turn = history + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And at sunset?"}]
        cold = engine.generate(turn, max_tokens=16, prefix_cache=False, **method)
        warm = engine.generate(turn, max_tokens=16, **method)
        assert warm.token_ids == cold.token_ids and warm.finish_reason == cold.finish_reason, method
        # Kangaroo reads its shared layers' states, which only the first turn's prefill kept, and
        # early exits' own K/V is never kept: both reuse the first prompt; every other method, the
        # answer too.
        least = 32 if method.get("spec_method") == "kangaroo" or "exit" in method else 96
        assert warm.stats.cached_tokens >= least, method
