"""The prefix cache's default budget follows the model and the machine (K/V for DEFAULT_TOKENS
tokens, at most 1/MEMORY_SHARE of the available memory, at most 1 GiB), a budget asked for wins,
`specee serve` says it when it starts, and under a stream of distinct requests the cache's bytes
level off at the budget."""
import pytest
from fastapi.testclient import TestClient

from helpers import tiny_model
from specee.engine import Engine
from specee.model.memory import kv_cache_bytes
from specee.prefix_cache import DEFAULT_TOKENS, MAX_DEFAULT_BYTES, MEMORY_SHARE, available_memory, default_budget_bytes
from specee.server.app import ServerConfig, create_app, start_line
from specee.server.completions import Defaults

MIB, GIB = 2**20, 2**30
SMOLLM2_135M = 2 * 30 * 3 * 64 * 4  # bytes of fp32 K/V per token: 30 layers, 3 KV heads of 64


@pytest.mark.parametrize("kv_per_token,available,expected", [
    (SMOLLM2_135M, 64 * GIB, SMOLLM2_135M * DEFAULT_TOKENS),  # a small model: its tokens' worth (360 MiB)
    (2 * 24 * 32 * 64 * 4, 64 * GIB, MAX_DEFAULT_BYTES),  # a 1.7B model without GQA: the 1 GiB cap
    (SMOLLM2_135M, 1 * GIB, GIB // MEMORY_SHARE),  # a small machine: its share of the memory
    (SMOLLM2_135M, None, SMOLLM2_135M * DEFAULT_TOKENS),  # memory unknown: the other two bounds
])
def test_the_default_budget_is_the_least_of_tokens_memory_and_a_gib(kv_per_token, available, expected):
    assert default_budget_bytes(kv_per_token, available) == expected


def test_the_machine_reports_its_available_memory():
    available = available_memory()
    assert available is None or 0 < available < 2**50


def test_an_engine_on_the_kernels_takes_the_default_and_an_asked_budget_wins(tiny_tokenizer, monkeypatch):
    model = tiny_model(seed=2, vocab_size=tiny_tokenizer.vocab_size)
    monkeypatch.setattr(type(model), "uses_kernels", property(lambda self: True))  # as on the CPU kernels
    monkeypatch.setattr("specee.engine.available_memory", lambda: 48 * MIB)
    per_token = kv_cache_bytes(model.config, 1)
    assert Engine(model, tiny_tokenizer).prefix_cache.budget_bytes == min(per_token * DEFAULT_TOKENS, 6 * MIB)
    assert Engine(model, tiny_tokenizer, prefix_cache_mb=100).prefix_cache.budget_bytes == 100 * MIB
    assert Engine(model, tiny_tokenizer, prefix_cache_mb=0).prefix_cache.budget_bytes == 0


def test_the_start_line_says_the_budget(tiny_tokenizer):
    model = tiny_model(seed=2, vocab_size=tiny_tokenizer.vocab_size)
    line = start_line("127.0.0.1", 8000, Engine(model, tiny_tokenizer, prefix_cache_mb=360))
    assert line.startswith("specee serving on http://127.0.0.1:8000") and "prefix cache up to 360 MiB" in line
    assert "prefix cache off" in start_line("127.0.0.1", 8000, Engine(model, tiny_tokenizer, prefix_cache_mb=0))


@pytest.mark.slow
def test_a_soak_of_distinct_conversations_levels_off_at_the_budget(tiny_tokenizer):
    """300 requests with distinct prompts through the server in process: the cache fills to its
    default budget (this tiny model's K/V for DEFAULT_TOKENS tokens), then evicts and stays there."""
    model = tiny_model(seed=4, vocab_size=tiny_tokenizer.vocab_size, max_position_embeddings=1024)
    budget = default_budget_bytes(kv_cache_bytes(model.config, 1), available_memory())
    engine = Engine(model, tiny_tokenizer, prefix_cache_mb=budget / MIB)
    cache, levels = engine.prefix_cache, []
    with TestClient(create_app(engine, ServerConfig("tiny", Defaults({"max_tokens": 8})))) as client:
        for i in range(300):
            words = " ".join(f"w{(i * 7 + j) % 997}" for j in range(40))  # ~100 tokens, distinct from the first block
            reply = client.post("/v1/completions", json={"prompt": f"{i} {words}", "max_tokens": 8})
            assert reply.status_code == 200
            levels.append(cache.bytes)
    block = cache.blocks[next(iter(cache.blocks))].nbytes
    assert max(levels) <= budget and cache.stats.evictions > 0
    full_from = next(i for i, level in enumerate(levels) if level > budget - 16 * block)
    assert full_from < 250 and min(levels[full_from:]) > budget - 16 * block  # it stays full: level
