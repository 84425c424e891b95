"""KV cache invariants: incremental decoding, rewind, compaction, per-layer lengths."""
import pytest
import torch

from helpers import tiny_model
from specee.model.cache import KVCache


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=4)


def greedy_continue(model, cache, last_token, n):
    out = []
    token = last_token
    for _ in range(n):
        logits = model(torch.tensor([token]), torch.tensor([cache.length]), cache)
        token = int(logits.argmax(-1))
        out.append(token)
    return out


def test_prefill_then_token_by_token_equals_one_full_forward(model):
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    with torch.no_grad():
        full = model(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(16))
        cache = model.new_cache(16)
        rows = [model(torch.tensor(ids[:4]), torch.arange(4), cache)]
        for pos in range(4, len(ids)):
            rows.append(model(torch.tensor([ids[pos]]), torch.tensor([pos]), cache))
    torch.testing.assert_close(torch.cat(rows), full, atol=1e-5, rtol=1e-5)
    assert cache.lengths == [len(ids)] * 3


def test_truncate_then_redecode_reproduces_the_same_tokens(model):
    prompt = [1, 2, 3, 4, 5, 6]
    with torch.no_grad():
        cache = model.new_cache(64)
        model(torch.tensor(prompt[:-1]), torch.arange(5), cache)
        first = greedy_continue(model, cache, prompt[-1], 12)
        cache.truncate(cache.length - 7)
        assert cache.lengths == [len(prompt) - 1 + 12 - 7] * 3
        redo = greedy_continue(model, cache, first[4], 7)
    assert redo == first[5:12]


def test_keep_moves_exactly_the_selected_positions():
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=2, max_len=10)
    for layer in range(2):
        values = torch.arange(8, dtype=torch.float32).repeat_interleave(2).view(8, 1, 2) + 100 * layer
        cache.append(layer, values, -values)
    cache.keep(start=3, indices=[3, 5, 7])
    assert cache.lengths == [6, 6]
    for layer in range(2):
        kept = cache.keys[layer, 0, :6, 0] - 100 * layer
        assert kept.tolist() == [0, 1, 2, 3, 5, 7]
        assert (cache.values[layer, 0, :6, 0] + 100 * layer).tolist() == [0, -1, -2, -3, -5, -7]


def test_keep_rejects_indices_outside_the_new_region():
    cache = KVCache(1, 1, 2, 10)
    cache.append(0, torch.zeros(5, 1, 2), torch.zeros(5, 1, 2))
    with pytest.raises(ValueError):
        cache.keep(start=3, indices=[2, 4])
    with pytest.raises(ValueError):
        cache.keep(start=3, indices=[3, 5])


def test_layers_keep_their_own_lengths():
    cache = KVCache(num_layers=3, num_kv_heads=1, head_dim=2, max_len=10)
    for layer, n in enumerate([5, 3, 3]):
        cache.append(layer, torch.ones(n, 1, 2), torch.ones(n, 1, 2))
    assert cache.lengths == [5, 3, 3] and cache.length == 5
    keys, _ = cache.append(1, torch.full((2, 1, 2), 7.0), torch.zeros(2, 1, 2))
    assert keys.shape == (1, 5, 2) and keys[0, 3:, 0].tolist() == [7.0, 7.0]
    cache.keep(start=4, indices=[4])  # only layers that wrote past 4 are compacted
    assert cache.lengths == [5, 5, 3]
    cache.truncate(4)
    assert cache.lengths == [4, 4, 3]


def test_a_rollback_forgets_the_deferred_rows_past_it():
    """Rows an early exit deferred go with their positions: a truncate forgets them too."""
    cache = KVCache(num_layers=3, num_kv_heads=1, head_dim=2, max_len=16)
    for layer, written in enumerate([8, 7, 5]):  # positions 5 and 6 miss layer 2, position 7 layers 1-2
        cache.append(layer, torch.zeros(written, 1, 2), torch.zeros(written, 1, 2))
    states = torch.arange(8.0).view(4, 2)
    cache.deferred.defer(states[:3], first=5, level=2)
    cache.deferred.defer(states[3:], first=7, level=1)  # position 7 exited earlier in a later pass
    assert cache.deferred.positions == [5, 6, 7] and cache.deferred.levels == [2, 2, 1]
    torch.testing.assert_close(cache.deferred.states, states[[0, 1, 3]])
    cache.truncate(7)
    assert cache.lengths == [7, 7, 5] and cache.deferred.positions == [5, 6] and cache.deferred.levels == [2, 2]
    torch.testing.assert_close(cache.deferred.states, states[:2])
    cache.truncate(5)
    assert cache.deferred.positions == [] and cache.deferred.states is None


def test_extending_a_range_of_layers_is_extending_each():
    """What the fused kernels' pass asks of the cache: room for n positions in consecutive layers
    at one length, the rest untouched, the storage grown as one layer's `extend` grows it."""
    one, whole = (KVCache(num_layers=4, num_kv_heads=1, head_dim=2, max_len=64) for _ in range(2))
    for cache in (one, whole):
        cache.append(3, torch.ones(2, 1, 2), torch.ones(2, 1, 2))
    for n in (5, 1, 17):
        for i in range(3):
            one.extend(i, n)
        whole.extend_layers(range(3), n)
        assert whole.lengths == one.lengths and whole.capacity == one.capacity
    assert whole.lengths == [23, 23, 23, 2]
    with pytest.raises(ValueError, match="full"):
        whole.extend_layers(range(3), 42)


def test_appending_past_the_end_is_an_error():
    cache = KVCache(1, 1, 2, max_len=4)
    with pytest.raises(ValueError, match="full"):
        cache.append(0, torch.zeros(5, 1, 2), torch.zeros(5, 1, 2))


def test_tree_mask_pass_matches_separate_chains(model):
    """Two branches verified in one pass with a tree mask give each branch's own logits."""
    prefix = [7, 8, 9]
    a, b = [10, 11], [20]
    with torch.no_grad():
        cache = model.new_cache(16)
        model(torch.tensor(prefix), torch.arange(3), cache)
        # nodes: a0 (depth 1), a1 (depth 2, child of a0), b0 (depth 1)
        mask = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
        tree = model(torch.tensor(a + b), torch.tensor([3, 4, 3]), cache, mask=mask)
        chain_a = model(torch.tensor(a), torch.tensor([3, 4]), _prefilled(model, prefix))
        chain_b = model(torch.tensor(b), torch.tensor([3]), _prefilled(model, prefix))
    torch.testing.assert_close(tree[:2], chain_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tree[2:], chain_b, atol=1e-5, rtol=1e-5)


def _prefilled(model, prefix):
    cache = model.new_cache(16)
    model(torch.tensor(prefix), torch.arange(len(prefix)), cache)
    return cache
