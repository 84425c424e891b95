"""Weight-only int8/int4: round trips within each format's bound, the kernels against the
dequantized weights, row-count independence (what lossless speculation rests on), GGUF blocks
read straight from a file against `gguf`'s own dequantization, and bad input."""
import pytest
import torch

from helpers import specee_from_hf, tiny_hf_model
from specee.model.quantize import (
    Int4Linear, Int8Linear, check_quantization, quantize_int4, quantize_int8, quantize_model,
)

# fp32 evaluation of (code - 8) * scale + zero rounds once more.
FP32_SLACK = 1e-6


def weights(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Gaussian weights with the awkward cases: an outlier row, an all-zero row, a constant row,
    and a row far from zero (its zero point is large next to its step)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[1] *= 40
    w[2] = 0
    w[3] = 0.3
    w[4] = 1.0 + torch.rand(cols, generator=g) * 0.01
    return w


def test_int8_round_trip_within_half_a_step_per_channel():
    w = weights(64, 96)
    q = quantize_int8(w)
    assert q.codes.dtype == torch.int8 and q.scales.dtype == torch.bfloat16
    error = (q.dequantize() - w).abs()  # [N, K]
    assert (error <= q.scales.float()[:, None] / 2 * (1 + FP32_SLACK)).all()
    assert error[2].max() == 0  # a zero row stays exactly zero


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_round_trip_within_half_a_step_per_group(group_size):
    w = weights(48, 128)
    q = quantize_int4(w, group_size)
    error = (q.dequantize() - w).abs().unflatten(1, (-1, group_size))  # [N, K / g, g]
    bound = q.scales.float()[..., None] / 2 + w.abs().max() * FP32_SLACK
    assert (error <= bound).all()
    assert q.codes().max() <= 15 and q.codes().shape == w.shape


def test_int4_needs_in_features_divisible_by_the_group_size():
    with pytest.raises(ValueError, match="112 is not a multiple of 64"):
        quantize_int4(torch.randn(16, 112), 64)


def x_and_rows(in_features: int, rows: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("linear", ["int8", "int4"])
def test_quantized_linear_is_x_times_its_dequantized_weight(linear):
    w = weights(97, 128)  # 97 rows: int4 pads to the packing's blocks of 16
    q = quantize_int8(w) if linear == "int8" else quantize_int4(w, 32)
    layer = Int8Linear(q) if linear == "int8" else Int4Linear(q)
    x = x_and_rows(128)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (16, 97)
    # The kernel rounds x to bf16, accumulates in fp32 and rounds its output to bf16.
    expected = x.bfloat16().float() @ q.dequantize().T
    torch.testing.assert_close(out, expected, rtol=2**-8, atol=1e-4)
    assert layer(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("linear", ["int8", "int4"])
def test_a_row_gets_the_same_bits_whatever_the_rows_beside_it(linear):
    """Speculation verifies 2-17 tokens in one pass; dense decoding runs one. Lossless holds in a
    quantized format only if a multi-row pass gives each row exactly its one-row result."""
    w = weights(576, 576)
    layer = Int8Linear(quantize_int8(w)) if linear == "int8" else Int4Linear(quantize_int4(w, 32))
    x = x_and_rows(576, rows=64)
    one_by_one = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
    for rows in (2, 3, 5, 8, 9, 13, 16, 17, 33, 64):
        assert torch.equal(layer(x[:rows]), one_by_one[:rows]), f"{rows} rows"


def one_token_logits(model, ids: list[int]) -> torch.Tensor:
    """The logits after each of `ids`, fed one token per pass: [len(ids), vocab]."""
    cache = model.new_cache(len(ids))
    return torch.cat([model(torch.tensor([token]), torch.tensor([i]), cache) for i, token in enumerate(ids)])


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_multi_token_pass_rounds_as_one_token_passes(name):
    """What lossless speculation in a quantized format rests on, for the whole model: a chain's
    or a tree's verification pass gives each row the bits one-token passes over its path give."""
    model = quantize_model(specee_from_hf(tiny_hf_model(seed=1, intermediate_size=128, vocab_size=112), pack=False),
                           name)
    prefix, chain = [5, 9, 2, 77, 100, 3, 41], [60, 61, 17, 99, 8]
    with torch.inference_mode():
        reference = one_token_logits(model, prefix + chain)
        cache = model.new_cache(32)
        model(torch.tensor(prefix), torch.arange(len(prefix)), cache)
        at = len(prefix)
        assert torch.equal(model(torch.tensor(chain), torch.arange(at, at + len(chain)), cache), reference[at:])
        # A tree over [root, a, b, c]: a and b are the root's children, c is a's.
        root, a, b, c = 60, 61, 70, 17
        mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        cache.truncate(at)
        tree = model(torch.tensor([root, a, b, c]), at + torch.tensor([0, 1, 1, 2]), cache, mask)
        assert torch.equal(tree[[0, 1, 3]], one_token_logits(model, prefix + [root, a, c])[at:])
        assert torch.equal(tree[2], one_token_logits(model, prefix + [root, b])[-1])


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("tied", [False, True])
def test_quantized_model_keeps_its_pieces_working(name, tied):
    hf = tiny_hf_model(seed=1, intermediate_size=128, vocab_size=112, tie_word_embeddings=tied)
    dense = specee_from_hf(hf, pack=False)
    model = quantize_model(specee_from_hf(hf, pack=False), name)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.dtype == torch.float32
    ids = torch.tensor([5, 9, 2, 77, 100])
    with torch.no_grad():
        # The embedding reads the int8 head's (tied) or its own int8 rows.
        torch.testing.assert_close(model.embed(ids), dense.embed(ids), atol=0.02, rtol=0.02)
        h = model.norm(torch.randn(3, 64))
        rows = torch.tensor([3, 111, 0, 41])
        # Sliced logits use the exact dequantized rows; full logits went through bf16.
        torch.testing.assert_close(model.logits(h, rows), model.logits(h)[:, rows], rtol=2**-7, atol=0.02)
        logits = model(ids, torch.arange(5), model.new_cache(8))
    assert logits.shape == (5, 112) and torch.isfinite(logits).all()
    assert model.weight_bytes < dense.weight_bytes / 3


def test_embedding_rows_of_recent_tokens_are_kept_within_their_budget(monkeypatch):
    """The kept rows are the dequantized ones exactly, whatever the call's mix of kept and new ids
    (repeats too); a pass cannot change them (the result is a copy); when the budget is reached the
    rows are dropped and read again; a prompt's many ids skip the cache."""
    from specee.model import quantize

    hf = tiny_hf_model(seed=1, intermediate_size=128, vocab_size=112, tie_word_embeddings=True)
    model = quantize_model(specee_from_hf(hf, pack=False), "int4")
    embedding = model.embed_tokens
    exact = lambda ids: embedding.dequantize(torch.tensor(ids)).to(embedding.dtype)  # noqa: E731
    monkeypatch.setattr(quantize, "EMBEDDING_CACHE_BYTES", 4 * 64 * 4)  # four rows of 64 fp32
    for ids in ([5], [5, 9, 5], [9, 2, 77], [100, 5]):
        out = model.embed(torch.tensor(ids))
        assert torch.equal(out, exact(ids))
        out.add_(1.0)  # what a caller does with it stays out of the kept rows
        assert len(embedding.recent) <= 4
    assert sorted(embedding.recent) == [100]  # a fifth row emptied the cache (5 was read from it first)
    assert torch.equal(model.embed(torch.tensor([[5], [100]])), exact([5, 100]).view(2, 1, -1))
    many = list(range(quantize.EMBEDDING_CACHED_IDS + 1))
    assert torch.equal(model.embed(torch.tensor(many)), exact(many)) and sorted(embedding.recent) == [5, 100]


def test_a_quantized_model_keeps_the_fingerprint_of_its_weights():
    from specee.model.fingerprint import weights_fingerprint

    dense = specee_from_hf(tiny_hf_model(seed=1, intermediate_size=128), pack=False)
    expected = weights_fingerprint(dense)
    for name in ("int8", "int4"):
        model = quantize_model(specee_from_hf(tiny_hf_model(seed=1, intermediate_size=128), pack=False), name)
        assert weights_fingerprint(model) == expected
    assert weights_fingerprint(specee_from_hf(tiny_hf_model(seed=2, intermediate_size=128), pack=False)) != expected


def test_weight_bytes_count_codes_and_scales():
    hf = tiny_hf_model(seed=0, intermediate_size=128, vocab_size=112, tie_word_embeddings=True)
    model = quantize_model(specee_from_hf(hf, pack=False), "int4")
    c = model.config
    layer_matrices = [(c.hidden_size, 128), (c.hidden_size, c.hidden_size), (c.hidden_size, 256), (128, c.hidden_size)]
    # int4: half a byte per weight, a bf16 scale and zero per group of 32; the int8 head: a byte per
    # weight and a bf16 scale per row; fp32 norms.
    int4 = sum(k * n // 2 + 2 * 2 * n * k // 32 for k, n in layer_matrices)
    head = c.vocab_size * c.hidden_size + 2 * c.vocab_size
    norms = (2 * c.num_hidden_layers + 1) * c.hidden_size * 4
    assert model.weight_bytes == c.num_hidden_layers * int4 + head + norms


@pytest.mark.parametrize("tied", [False, True])
def test_the_hf_baseline_counts_the_dense_bytes_whatever_our_format(tied):
    from specee.eval.modes import dense_weight_bytes

    hf = tiny_hf_model(seed=0, tie_word_embeddings=tied)
    assert dense_weight_bytes(hf) == specee_from_hf(hf).weight_bytes


def test_auto_picks_int4_on_the_cpu_int8_when_groups_do_not_fit_and_none_on_a_gpu():
    from specee.model.quantize import automatic_quantization

    fits = specee_from_hf(tiny_hf_model(seed=0, intermediate_size=128), pack=False).config
    odd = specee_from_hf(tiny_hf_model(seed=0), pack=False).config  # intermediate_size 112
    assert automatic_quantization(fits, "cpu") == "int4"
    assert automatic_quantization(odd, "cpu") == "int8"
    assert automatic_quantization(fits, "cuda") == "none"
    check_quantization("auto", "cuda")  # auto is never refused: it resolves to none there


def test_quantizing_by_blocks_of_rows_equals_all_at_once_and_replaces_every_linear(monkeypatch):
    import specee.model.quantize as q

    w = weights(2 * q.QUANTIZE_ROWS_PER_BLOCK + 100, 64)
    by_blocks = quantize_int8(w)
    monkeypatch.setattr(q, "QUANTIZE_ROWS_PER_BLOCK", w.shape[0])
    at_once = quantize_int8(w)
    assert torch.equal(by_blocks.codes, at_once.codes) and torch.equal(by_blocks.scales, at_once.scales)
    model = quantize_model(specee_from_hf(tiny_hf_model(seed=0, intermediate_size=128), pack=False), "int4")
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())


def test_bad_quantization_requests_are_clear_errors():
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        check_quantization("int3")
    with pytest.raises(ValueError, match="CPU only"):
        check_quantization("int8", "cuda")
    odd = specee_from_hf(tiny_hf_model(seed=0), pack=False)  # intermediate_size 112
    with pytest.raises(ValueError, match="112 is not a multiple of 32"):
        quantize_model(odd, "int4")
    with pytest.raises(ValueError, match="before CPU packing"):
        quantize_model(specee_from_hf(tiny_hf_model(seed=0)), "int8")


# GGUF blocks read straight from a file.

def write_gguf(path, tensors: dict) -> None:
    """A tiny GGUF with the metadata a config needs and `tensors` {name: (fp32 array, type)}."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_block_count(1)
    writer.add_head_count(4)
    writer.add_vocab_size(112)
    for name, (array, qtype) in tensors.items():
        data = gguf.quants.quantize(array, qtype) if qtype not in (gguf.GGMLQuantizationType.F32,) else array
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow
def test_default_model_tensors_equal_gguf_dequantization():
    """The shipped file's Q4_1 layers and Q8_0 embedding, read as the loader reads them: Q8_0 as
    grouped int8 with the file's values exactly, Q4_1 as int4 with bf16 scales and zero points."""
    import gguf
    from gguf.quants import dequantize

    from specee.model.gguf_weights import read_gguf_weights
    from specee.model.loading import default_model_path

    tensors = {t.name: t for t in gguf.GGUFReader(str(default_model_path())).tensors}
    state = read_gguf_weights(default_model_path(), "gguf").state_dict
    down = state["model.layers.0.mlp.down_proj.weight"]
    expected = torch.from_numpy(dequantize(tensors["blk.0.ffn_down.weight"].data, gguf.GGMLQuantizationType.Q4_1).copy())
    step = down.scales.float().repeat_interleave(32, dim=1)
    # bf16 scales and zero points: every weight within 1/16 of its group's step of the file's value.
    assert ((down.dequantize() - expected).abs() <= step / 16 + 1e-6).all()
    assert not torch.equal(down.dequantize(), expected)  # the rounding is real, so the bound is tested
    embedding = state["model.embed_tokens.weight"]
    rows = torch.arange(2048)
    expected8 = torch.from_numpy(dequantize(tensors["token_embd.weight"].data[:2048], gguf.GGMLQuantizationType.Q8_0).copy())
    assert torch.equal(embedding.dequantize(rows) + 0.0, expected8 + 0.0)


def test_a_rows_price_follows_the_multiply_adds_per_weight_byte():
    """The kernels' row cost was measured on the default model; another model's scales with how
    many multiply-adds a row makes per byte a pass reads (more bytes per weight, or a larger int8
    head: a cheaper row, relative to the pass)."""
    from specee.model.kernels import cpu_kernels
    from specee.model.quantize import KERNEL_ROW_COST, REFERENCE_MULTIPLY_ADDS_PER_BYTE

    kernels = cpu_kernels()
    prices = {}
    for name in ("int4", "int8"):
        model = quantize_model(specee_from_hf(tiny_hf_model(seed=1, intermediate_size=128), pack=False), name,
                               kernels=kernels)
        c = model.config
        per_layer = c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim \
            + c.num_attention_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
        multiply_adds = c.num_hidden_layers * per_layer + c.hidden_size * c.vocab_size
        assert model.multiply_adds_per_byte == pytest.approx(multiply_adds / model.weight_bytes)
        assert model.extra_row_cost == pytest.approx(
            KERNEL_ROW_COST[kernels.tier] * model.multiply_adds_per_byte / REFERENCE_MULTIPLY_ADDS_PER_BYTE)
        prices[name] = model.extra_row_cost
    assert prices["int8"] < prices["int4"]  # twice the bytes per weight, the same multiply-adds
