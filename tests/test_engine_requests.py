"""Generations are isolated: each has its own KV cache (sized to what it can use) and its own
drafting state, so interleaved streams on one engine give what they give alone."""
import pytest
import torch

from helpers import tiny_model
from specee.engine import CACHE_SLACK, INITIAL_OUTPUT_SLOTS, Engine
from specee.model.cache import KVCache, SpareBuffers
from specee.strategies.base import Step, Strategy

PROMPTS = ["Repeat exactly: the red fox, the red fox, the red fox.", "Count from one to ten in words."]


@pytest.fixture(scope="module")
def engine(tiny_tokenizer):
    """A tiny random model, where the real model's answers do not matter."""
    model = tiny_model(seed=5, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=2)
    return Engine(model, tiny_tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    dict(),
    dict(spec_method="prompt-lookup"),
    dict(spec_method="hybrid", tree="auto"),
    dict(spec_method="draft", draft_model="self:1", temperature=0.8, seed=3),
])
def test_interleaved_streams_equal_separate_runs(default_engine, options):
    engine = default_engine
    alone = [engine.generate(p, max_tokens=24, ignore_eos=True, **options) for p in PROMPTS]
    strategy = engine.strategy(options.get("spec_method"), **{k: v for k, v in options.items()
                                                              if k in ("tree", "draft_model")})
    sampling = {k: v for k, v in options.items() if k in ("temperature", "seed")}
    streams = [engine.stream(p, max_tokens=24, ignore_eos=True, strategy=strategy, **sampling) for p in PROMPTS]
    iterators = [iter(s) for s in streams]
    live = list(range(len(iterators)))
    while live:  # one step of each in turn, sharing one strategy object
        for i in list(live):
            try:
                next(iterators[i])
            except StopIteration:
                live.remove(i)
    for stream, result in zip(streams, alone):
        assert stream.result.token_ids == result.token_ids
        assert stream.result.text == result.text
    if options.get("spec_method") in ("prompt-lookup", "hybrid"):
        assert sum(s.result.stats.draft_tokens_accepted for s in streams) > 0  # drafts were in play


def test_a_huge_max_tokens_allocates_only_what_is_used(engine):
    context = engine.context_length
    cache = engine.new_cache(prompt_tokens=10, max_tokens=context - 10)
    assert cache.max_len >= context
    assert cache.capacity <= 10 + INITIAL_OUTPUT_SLOTS + 100
    # A stop string the model is known to write: the huge request ends there, with what it wrote.
    reference = engine.generate(PROMPTS[0], max_tokens=30, ignore_eos=True).text
    stop = reference[len(reference) // 2:][:6]
    result = engine.generate(PROMPTS[0], max_tokens=context - 100, ignore_eos=True, stop=[stop])
    assert result.finish_reason == "stop"
    assert result.text == reference[:reference.index(stop)]


def test_cache_grows_and_keeps_what_it_holds():
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=4, max_len=40, capacity=3)
    written = torch.arange(2 * 4 * 4, dtype=torch.float32).view(2, 4, 1, 4)  # [layer, T, heads, dim]
    for layer in range(2):
        cache.append(layer, written[layer, :2], -written[layer, :2])
    for layer in range(2):
        keys, values = cache.append(layer, written[layer, 2:], -written[layer, 2:])  # past capacity 3
        torch.testing.assert_close(keys, written[layer].transpose(0, 1))
        torch.testing.assert_close(values, -written[layer].transpose(0, 1))
    assert cache.capacity >= 4 and cache.lengths == [4, 4]
    with pytest.raises(ValueError, match="at most 40"):
        cache.append(0, torch.zeros(37, 1, 4), torch.zeros(37, 1, 4))


def test_spare_buffers_give_the_smallest_pair_that_fits_within_their_budget():
    def cache(capacity):
        return KVCache(num_layers=2, num_kv_heads=1, head_dim=4, max_len=100, capacity=capacity)

    pair_bytes = 2 * 2 * 1 * 10 * 4 * 4  # keys and values of 10 positions
    spares = SpareBuffers(budget=pair_bytes * 3)  # three of 10 positions, or one of 10 and one of 20
    small, large = cache(10), cache(20)
    small_keys, large_keys = small.keys, large.keys
    spares.give(small)
    spares.give(large)
    assert small.keys is None and large.keys is None  # a cache given back writes nowhere
    assert KVCache(2, 1, 4, 100, capacity=8, spares=spares).keys is small_keys  # the smallest that holds 8
    assert KVCache(2, 1, 4, 100, capacity=15, spares=spares).keys.data_ptr() == large_keys.data_ptr()
    assert spares.buffers == []  # the 20 went to the 15; nothing left
    spares.give(cache(10))
    spares.give(cache(20))
    spares.give(cache(10))  # over the budget: the oldest goes
    assert [keys.shape[2] for keys, _ in spares.buffers] == [20, 10]
    assert KVCache(2, 2, 4, 100, capacity=5, spares=spares).keys.shape == (2, 2, 5, 4)  # other heads: fresh
    assert len(spares.buffers) == 2
    spares.give(KVCache(2, 1, 4, 1000, capacity=1000))  # larger than the whole budget: not kept
    assert [keys.shape[2] for keys, _ in spares.buffers] == [20, 10]


def test_a_finished_generation_leaves_its_buffers_to_the_next_and_an_abandoned_one_does_not(tiny_tokenizer):
    model = tiny_model(seed=5, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=2)
    engine, fresh = Engine(model, tiny_tokenizer), Engine(model, tiny_tokenizer)
    first = engine.generate(PROMPTS[1], max_tokens=60, ignore_eos=True)  # a cache the others fit in
    assert len(engine.spare_buffers.buffers) == 1
    stream = engine.stream(PROMPTS[0], max_tokens=30, ignore_eos=True, spec_method="prompt-lookup")
    events = iter(stream)
    next(events)
    assert engine.spare_buffers.buffers == []  # the running generation writes into them
    events.close()  # abandoned: its cache is not given back
    assert engine.spare_buffers.buffers == []
    engine.generate(PROMPTS[1], max_tokens=60, ignore_eos=True)
    kept = engine.spare_buffers.buffers[0][0].data_ptr()
    for prompt in PROMPTS:  # each written over the buffers of the one before: the same tokens as alone
        again = engine.generate(prompt, max_tokens=30, ignore_eos=True, spec_method="prompt-lookup")
        assert [keys.data_ptr() for keys, _ in engine.spare_buffers.buffers] == [kept]
        alone = fresh.generate(prompt, max_tokens=30, ignore_eos=True, spec_method="prompt-lookup")
        fresh.spare_buffers.buffers.clear()
        assert again.token_ids == alone.token_ids
    assert engine.generate(PROMPTS[1], max_tokens=60, ignore_eos=True).token_ids == first.token_ids


def test_a_conversations_next_call_writes_into_the_buffers_of_the_one_before(tiny_tokenizer):
    """A first allocation rounds up to a power of two: the next call, whose prompt is this one's
    answer and a little more, fits in what it leaves."""
    model = tiny_model(seed=5, vocab_size=tiny_tokenizer.vocab_size, num_hidden_layers=2,
                       max_position_embeddings=4096)
    engine = Engine(model, tiny_tokenizer)
    prompt = tiny_tokenizer.encode_prompt(PROMPTS[0])
    cache = engine.new_cache(len(prompt), 40)
    assert cache.capacity == 1 << (len(prompt) + 40 + CACHE_SLACK - 1).bit_length() > cache.max_len
    engine.spare_buffers.give(cache)
    first = engine.generate(prompt, max_tokens=40, ignore_eos=True)
    kept = [keys.data_ptr() for keys, _ in engine.spare_buffers.buffers]
    assert len(kept) == 1
    engine.generate(prompt + first.token_ids + prompt[:10], max_tokens=40, ignore_eos=True)  # the next turn
    assert [keys.data_ptr() for keys, _ in engine.spare_buffers.buffers] == kept


class ScriptedStrategy(Strategy):
    """Yields fixed steps."""

    name = "scripted"

    def __init__(self, steps):
        self.steps = steps

    def decode(self, state):
        yield from self.steps


def test_events_say_how_many_tokens_were_accepted_drafts(engine):
    steps = [Step([100]), Step([101, 102, 103], 2), Step([104, 105, 106], 2, exit_layer=7)]
    events = list(engine.stream(PROMPTS[0], max_tokens=5, ignore_eos=True, strategy=ScriptedStrategy(steps)))
    assert [(e.token_ids, e.drafted, e.exit_layer) for e in events] == [
        ([100], 0, None), ([101, 102, 103], 2, None), ([104], 1, 7)]
    assert events[-1].finish_reason == "length"  # cut one token into a step: that token was a draft


class CountingStrategy(ScriptedStrategy):
    """Yields fixed steps and counts each one's drafts as a verifier does: accepted when yielded."""

    def decode(self, state):
        for step in self.steps:
            state.stats.record_pass(step.drafted + 1, step.drafted)
            yield step


def test_accepted_drafts_cut_at_max_tokens_are_not_counted(engine):
    steps = [Step([100]), Step([101, 102, 103], 2), Step([104, 105, 106, 107], 3)]
    stream = engine.stream(PROMPTS[0], max_tokens=5, ignore_eos=True, strategy=CountingStrategy(steps))
    events = list(stream)
    assert sum(e.drafted for e in events) == 3  # two from the second pass, one of the last one's three
    assert stream.result.stats.draft_tokens_accepted == 3
    assert stream.result.stats.draft_tokens_proposed == 8  # proposed drafts were all verified


@pytest.mark.slow
def test_dense_events_hold_only_the_targets_tokens_and_speculative_ones_lead_with_drafts(default_engine):
    dense = list(default_engine.stream(PROMPTS[0], max_tokens=12, ignore_eos=True, spec_method="none"))
    assert all(e.drafted == 0 for e in dense)
    stream = default_engine.stream(PROMPTS[0], max_tokens=40, ignore_eos=True, spec_method="prompt-lookup")
    events = list(stream)
    stats = stream.result.stats
    assert 1 + sum(stats.accept_lengths) == len(stream.result.token_ids)  # no pass cut at max_tokens
    # Events agree with the verifier's own accounting: the prompt's token, then one event a pass
    # carrying what that pass accepted, its accepted drafts marked.
    assert [len(e.token_ids) for e in events] == [1, *stats.accept_lengths]
    assert sum(e.drafted for e in events) == stats.draft_tokens_accepted > 0
