"""The fp16 KV cache (`--kv-cache-dtype fp16`, on the compiled CPU kernels): each key and value is
stored rounded to the nearest half, and attention over it gives exactly what it gives over an fp32
cache holding the same halves, in every tier, for every row of a pass as for the row alone. So
speculative decoding on it stays lossless against dense decoding on it."""
from __future__ import annotations

import dataclasses
import random
import subprocess
import sys

import pytest
import torch

from helpers import cpu_tier_params
from specee.model.kernels import load_tier
from test_batch_invariance import check_rows, kernel_model, random_tree, tree_pass

NO_MASK = torch.empty(0, dtype=torch.uint8)
NO_COUNTS = torch.empty(0, dtype=torch.long)


@pytest.fixture(scope="module", params=cpu_tier_params())
def kernels(request):
    return load_tier(request.param)


def half_cache(seed: int, positions: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(3, positions, 64, generator=g) * 2).half(), torch.randn(3, positions, 64, generator=g).half()


@pytest.mark.parametrize("T", [1, 3, 13, 40])  # 40 rows: more (row, head) pairs than one batch takes
def test_attention_over_halves_equals_attention_over_the_same_values_in_fp32(kernels, T):
    keys, values = half_cache(seed=T)
    q = torch.randn(T, 9, 64, generator=torch.Generator().manual_seed(100 + T))
    past = 137 - T  # key counts that are not multiples of 16
    visible = torch.arange(past + 1, past + T + 1)
    mask = (torch.rand(T, T, generator=torch.Generator().manual_seed(T)) < 0.5).to(torch.uint8) | torch.eye(T, dtype=torch.uint8)
    for window in (0, 20):
        halves = kernels.attention(q, keys, values, visible, NO_MASK, 0, past + T, window, 0.125)
        assert torch.equal(halves, kernels.attention(q, keys.float(), values.float(), visible, NO_MASK, 0, past + T,
                                                     window, 0.125))
        tree = kernels.attention(q, keys, values, NO_COUNTS, mask, past, past + T, window, 0.125)
        assert torch.equal(tree, kernels.attention(q, keys.float(), values.float(), NO_COUNTS, mask, past, past + T,
                                                   window, 0.125))
        for t in range(T):  # each row as it would attend alone
            alone = kernels.attention(q[t:t + 1].contiguous(), keys, values, visible[t:t + 1], NO_MASK, 0,
                                      past + t + 1, window, 0.125)
            assert torch.equal(alone[0], halves[t]), f"row {t}"
    assert not torch.equal(halves, kernels.attention(q, keys.float() * 1.001, values.float(), visible, NO_MASK, 0,
                                                     past + T, 0, 0.125))


# Below the smallest subnormal's half (to zero, a tie to the even zero), subnormals and their ties,
# the smallest normal, ties between normals, the largest half, the first value that rounds past it,
# infinities and signed zeros.
EDGES = [1e-9, 2.0 ** -25, 2.0 ** -25 * 1.5, 2.0 ** -24, 3 * 2.0 ** -25, 5 * 2.0 ** -25, 2.0 ** -14 - 2.0 ** -25,
         2.0 ** -14, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -11 + 2.0 ** -20, 65504.0, 65519.0, 65520.0,
         1e6, float("inf"), 0.0, 1 / 3, 3.14159]


def test_the_cache_stores_each_key_and_value_rounded_to_the_nearest_half(kernels):
    """rotate_and_store into halves: IEEE round to nearest, ties to even (PyTorch's own conversion),
    the queries as an fp32 cache gives them; NaN stays NaN."""
    heads, kv_heads, hd, T = 2, 1, 64, 2
    edges = torch.tensor(EDGES + [-x for x in EDGES])
    qkv = torch.randn(T, (heads + 2 * kv_heads) * hd, generator=torch.Generator().manual_seed(3)) * 4
    qkv[:, -hd:] = torch.cat((edges, torch.randn(2 * hd - len(edges)))).view(T, hd)  # the values
    qkv[0, -1] = float("nan")
    cos, sin = torch.randn(T, hd), torch.randn(T, hd)
    k16, v16 = torch.zeros(kv_heads, 8, hd, dtype=torch.half), torch.zeros(kv_heads, 8, hd, dtype=torch.half)
    k32, v32 = torch.zeros(kv_heads, 8, hd), torch.zeros(kv_heads, 8, hd)
    q16 = kernels.rotate_and_store(qkv, cos, sin, k16, v16, 3, heads)
    q32 = kernels.rotate_and_store(qkv, cos, sin, k32, v32, 3, heads)
    assert torch.equal(q16, q32) and torch.equal(k16, k32.half())
    stored, expected = v16.view(torch.int16), v32.half().view(torch.int16)
    nan = v32.isnan()
    assert torch.equal(stored[~nan], expected[~nan]) and v16[nan].isnan().all()
    assert float(v16[0, 3, EDGES.index(65520.0)]) == float("inf") and float(v16[0, 3, EDGES.index(65519.0)]) == 65504.0
    assert float(v16[0, 3, EDGES.index(2.0 ** -25)]) == 0.0 and float(v16[0, 3, EDGES.index(3 * 2.0 ** -25)]) == 2.0 ** -23


@pytest.mark.parametrize("tier", cpu_tier_params())
def test_every_row_of_a_pass_on_a_half_cache_equals_its_one_token_pass(tier):
    """Batch invariance holds on the fp16 cache, chains and trees of 1..20 new tokens, every tier."""
    model = kernel_model("int4", tier=tier)
    model.kv_cache_dtype = torch.float16
    rng = random.Random(tier)
    compared = check_rows(model, rng, sizes=[1, 2, 5, 9, 16, 20], vocab=model.config.vocab_size)
    assert compared == 2 * (1 + 2 + 5 + 9 + 16 + 20)


@pytest.mark.parametrize("tier", cpu_tier_params(portable=False))
def test_every_tier_gives_the_portable_tiers_logits_on_a_half_cache(tier):
    rng = random.Random(11)
    prefix, tokens = [rng.randrange(160) for _ in range(30)], [rng.randrange(160) for _ in range(9)]
    parents = random_tree(rng, 9, chain=False)
    logits = {}
    for name in (tier, "portable"):
        model = kernel_model("int8", tier=name, architecture="gemma3")
        model.kv_cache_dtype = torch.float16
        logits[name] = tree_pass(model, prefix, tokens, parents)
        model.kv_cache_dtype = torch.float32
        full = tree_pass(model, prefix, tokens, parents)
    assert torch.equal(logits[tier], logits["portable"])
    assert not torch.equal(logits["portable"], full)  # the halves are not the fp32 values


def test_a_cache_of_halves_is_refused_without_the_compiled_kernels():
    from specee.loader import kv_cache_element

    with pytest.raises(ValueError, match="compiled CPU kernels"):
        kv_cache_element("fp16", False, "gguf")
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        kv_cache_element("fp8", True, "gguf")
    assert kv_cache_element("fp16", True, "none") == torch.float16
    assert kv_cache_element("fp32", True, "gguf") == kv_cache_element("fp32", False, "none") == torch.float32


@pytest.mark.parametrize("attend, quantization, expected", [
    (True, "gguf", torch.float16), (True, "int4", torch.float16), (True, "int8", torch.float16),
    (True, "none", torch.float32),  # fp32 weights keep the Hugging Face reference's answers
    (False, "gguf", torch.float32), (False, "none", torch.float32)])  # no attention that reads halves
def test_auto_keeps_halves_where_quantized_weights_attend_on_the_kernels(attend, quantization, expected):
    from specee.loader import kv_cache_element

    assert kv_cache_element("auto", attend, quantization) == expected


def test_the_options_offer_the_loaders_cache_dtypes():
    from specee.loader import KV_CACHE_CHOICES
    from specee.options import LoadOptions

    field = next(f for f in dataclasses.fields(LoadOptions) if f.name == "kv_cache_dtype")
    assert tuple(field.metadata["choices"]) == KV_CACHE_CHOICES and field.default == "auto"


def test_the_memory_check_counts_two_bytes_an_element():
    from specee.model.config import LlamaConfig
    from specee.model.memory import kv_cache_bytes

    config = LlamaConfig(num_hidden_layers=30, num_key_value_heads=3, hidden_size=576, num_attention_heads=9,
                         intermediate_size=1536, vocab_size=49152)
    assert kv_cache_bytes(config, 4096, 2) * 2 == kv_cache_bytes(config, 4096) == 2 * 30 * 3 * 64 * 4096 * 4


@pytest.mark.slow
def test_speculative_decoding_on_a_half_cache_gives_dense_decodings_tokens():
    """On the default model with --kv-cache-dtype fp16: chains, trees and `auto` give dense
    decoding's tokens on the same cache, accepting and rejecting drafts; the answers differ from
    those of the same weights on an fp32 cache somewhere (the halves change the numbers); a prompt's
    K/V reused from the prefix cache gives the same answer."""
    import specee

    from test_speculative_lossless import PROMPTS

    engine = specee.load(kv_cache_dtype="fp16", suffix_cache_tokens=0)  # no earlier answer to copy whole
    assert engine.model.kv_cache_dtype == torch.float16 and engine.model.new_cache(8).keys.dtype == torch.float16
    full_cache = specee.load(kv_cache_dtype="fp32", suffix_cache_tokens=0)
    assert full_cache.model.new_cache(8).keys.dtype == torch.float32
    differs, answers = False, {}
    for prompt in PROMPTS[:4]:
        dense = engine.generate(prompt, max_tokens=64, ignore_eos=True, spec_method="none")
        answers[prompt] = dense.token_ids
        for config in (dict(), dict(spec_method="prompt-lookup", tree="auto", tree_budget=12),
                       dict(spec_method="ngram")):
            result = engine.generate(prompt, max_tokens=64, ignore_eos=True, **config)
            assert result.token_ids == dense.token_ids, (prompt, config)
            stats = result.stats
            assert stats.draft_tokens_accepted > 0 or config.get("spec_method") == "ngram", (prompt, config)
            assert stats.draft_tokens_proposed > stats.draft_tokens_accepted, (prompt, config)
        full = full_cache.generate(prompt, max_tokens=64, ignore_eos=True, spec_method="none")
        differs = differs or full.token_ids != dense.token_ids
    assert differs
    again = engine.generate(PROMPTS[0], max_tokens=64, ignore_eos=True, spec_method="none")
    assert again.stats.cached_tokens > 0 and again.token_ids == answers[PROMPTS[0]]  # its K/V from the prefix cache


@pytest.mark.slow
def test_the_command_line_keeps_halves_by_default_and_says_so():
    """The default model in its default format (the file's blocks, on the kernels) keeps an fp16
    cache; --kv-cache-dtype fp32 keeps floats; fp16 off the kernels is refused."""
    done = subprocess.run([sys.executable, "-m", "specee", "generate", "Say hi.", "--max-tokens", "4"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "KV cache fp16 up to 0.09 GiB" in done.stderr
    floats = subprocess.run([sys.executable, "-m", "specee", "generate", "Say hi.", "--max-tokens", "4",
                             "--kv-cache-dtype", "fp32"], capture_output=True, text=True, timeout=300)
    assert floats.returncode == 0, floats.stderr
    assert "KV cache up to 0.18 GiB" in floats.stderr
    refused = subprocess.run([sys.executable, "-m", "specee", "generate", "Say hi.", "--kv-cache-dtype", "fp16",
                              "--no-compile"], capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "--kv-cache-dtype fp16 runs on specee's compiled CPU kernels" in refused.stderr
