"""The prefix cache: a prompt that begins like an earlier prompt or answer takes those blocks' K/V
and prefills only the rest, with the same tokens as without the cache (the kernels give a row the
same bits however the prompt is cut), for every strategy; bounded by its budget, least recently
used first; keyed by tokens only; only whole, committed positions are kept."""
import random

import pytest
import torch

from helpers import tiny_model
from specee.engine import Engine
from specee.model.llama import PassRows
from specee.prefix_cache import PrefixCache
from test_batch_invariance import kernel_model

BLOCK = 32
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
    kv = model.new_cache(128)
    tokens = prompt(4, 128)
    with torch.inference_mode():
        model.run_pass(PassRows(torch.tensor(tokens), torch.arange(128), kv))
    one_block = PrefixCache(1 << 40)
    one_block.store(tokens[:BLOCK], kv)
    block_bytes = one_block.bytes
    cache.budget_bytes = 3 * block_bytes  # room for three blocks
    cache.store(tokens, kv)  # four: the chain's last is evicted first
    assert len(cache.blocks) == 3 and cache.bytes <= cache.budget_bytes and cache.stats.evictions == 1
    assert len(cache.lookup(tokens + [0], need_hidden=False)) == 3
    other = prompt(5, 64)
    with torch.inference_mode():
        kv2 = model.new_cache(64)
        model.run_pass(PassRows(torch.tensor(other), torch.arange(64), kv2))
    cache.store(other, kv2)  # two more blocks: the first chain loses its end again, never its start
    assert cache.bytes <= cache.budget_bytes
    assert len(cache.lookup(tokens + [0], need_hidden=False)) == 1
    assert len(cache.lookup(other + [0], need_hidden=False)) == 2


def test_a_restored_prefix_is_bit_identical_to_its_prefill(engine):
    model = engine.model
    tokens = prompt(6, 64)
    cache = PrefixCache(1 << 30)
    with torch.inference_mode():
        full = model.new_cache(80)
        model.run_pass(PassRows(torch.tensor(tokens), torch.arange(64), full))
        cache.store(tokens, full)
        restored = model.new_cache(80)
        cache.restore(cache.lookup(tokens + [1], need_hidden=False), restored)
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
    assert len(cache.blocks) == 1
    kv.lengths[1] = 96
    kv.deferred.positions, kv.deferred.levels = [70], [1]  # a row waiting for its deeper layers
    cache.store(tokens, kv)
    assert len(cache.blocks) == 2
    cache.store(tokens[:50], kv)  # tokens not (yet) committed are not keys of anything
    assert len(cache.blocks) == 2


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


def test_off_when_asked_and_where_kernels_are_not_batch_invariant(tiny_tokenizer):
    eager = Engine(tiny_model(seed=1, vocab_size=tiny_tokenizer.vocab_size), tiny_tokenizer)
    assert not eager.prefix_cache.enabled  # PyTorch's own kernels: bits depend on the pass's shape
    off = Engine(kernel_model("none", seed=8), tiny_tokenizer, prefix_cache_mb=0)
    tokens = prompt(9, 70)
    off.generate(tokens, max_tokens=1)
    assert not off.prefix_cache.blocks and off.generate(tokens, max_tokens=1).stats.cached_tokens == 0


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["none", "int8", "gguf"])
def test_every_method_on_the_default_model_answers_the_same_with_the_cache(quantization):
    """The real model in three formats: a second turn resent with its history gets the same tokens
    from every lossless method with the cache as without, and reuses the history's blocks."""
    import specee

    engine = specee.load(quantization=quantization)
    history = [{"role": "system", "content": "You answer in one short paragraph. " * 6},
               {"role": "user", "content": "Why is the sky blue?"}]
    for method in (None, "prompt-lookup", "hybrid", "eagle", "kangaroo"):
        engine.prefix_cache.clear()
        first = engine.generate(history, max_tokens=40, spec_method=method)
        turn = history + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And at sunset?"}]
        cold = engine.generate(turn, max_tokens=16, spec_method=method, prefix_cache=False)
        warm = engine.generate(turn, max_tokens=16, spec_method=method)
        assert warm.token_ids == cold.token_ids, method
        # Kangaroo prefills whole prompts (it reads its shared layers' states); EAGLE reuses the
        # blocks that hold the last layer's states, a prompt's (an answer's do not keep them).
        least = {"kangaroo": 0, "eagle": 32}.get(method, 96)
        assert warm.stats.cached_tokens >= least, method
