"""The compiled CPU kernels (`specee/model/kernels/`), in every tier this CPU runs: each against a
plain reference, each row's result independent of the other rows of the call, every tier's bits
equal to the portable tier's; the tier choice and the build cache."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specee.model.integer_linear import IntegerLinear
import specee.model.kernels as kernels_module
from helpers import cpu_tier_params, threads
from specee.model.kernels import (KernelsUnavailable, bindings_directory, cpu_kernels, load_tier, supported_tiers,
                                  tier_library, tier_named)
from specee.model.quantize import (GroupedInt8Weight, SuperblockInt8Weight, cat_rows, quantize_grouped_int8,
                                   quantize_int4, quantize_int8, quantized_linear)
from specee.model.rope import apply_rope, rope_angles

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", params=cpu_tier_params())
def kernels(request):
    return load_tier(request.param)


@pytest.fixture(scope="module", params=cpu_tier_params(portable=False))
def other_tier(request):
    """A tier that is not the portable one, for the checks against it."""
    return load_tier(request.param)


@pytest.fixture(scope="module")
def portable():
    return load_tier("portable")


def rows(T: int, K: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(T, K, generator=torch.Generator().manual_seed(seed)) * 3


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """What the kernels multiply: each row in blocks of 32, scaled to int8 by the block's largest
    magnitude and rounded to nearest even, as fp64 values."""
    blocks = x.view(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    codes = torch.round(blocks * torch.where(scale > 0, 1 / scale, 0))
    return (codes.double() * scale.double()).view_as(x)


def quantized(w: torch.Tensor, bits: int, group: int):
    """w in a format of the kernels: int4 in groups, int8 per row (group 0) or int8 in groups."""
    if bits == 4:
        return quantize_int4(w, group)
    return quantize_grouped_int8(w, group) if group else quantize_int8(w)


FORMATS = [(4, 32), (8, 0), (8, 32), (8, 16)]  # bits, group


@pytest.mark.parametrize("bits,group", FORMATS)
@pytest.mark.parametrize("shape", [(960, 576), (97, 128), (16, 1536)])
def test_integer_linear_is_int8_activations_times_the_dequantized_weight(kernels, bits, group, shape):
    N, K = shape
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(1)) * 0.05
    weight = quantized(w, bits, group)
    layer = quantized_linear(weight, kernels=kernels)
    assert isinstance(layer, IntegerLinear) and layer.bits == bits
    x = rows(9, K)
    expected = int8_activations(x) @ weight.dequantize().double().T
    out = layer(x)
    assert out.shape == (9, N) and out.dtype == torch.float32
    # Integer sums are exact; only the fp32 scaling of each block rounds.
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("bits,group", FORMATS)
def test_threads_taking_the_tiles_as_they_come_compute_each_once_as_one_thread_does(kernels, bits, group):
    """The tiles of a matmul go to the threads in runs, each thread taking the next as it comes: on
    3 and 5 threads every one of 75 tiles (the last partial) gets one thread's bits."""
    w = torch.randn(1190, 576, generator=torch.Generator().manual_seed(4)) * 0.05
    layer = quantized_linear(quantized(w, bits, group), kernels=kernels)
    x = rows(5, 576, seed=5)
    with threads(1):
        one = layer(x)
    for count in (3, 5):
        with threads(count):
            assert torch.equal(layer(x), one), f"{count} threads"
    expected = int8_activations(x) @ quantized(w, bits, group).dequantize().double().T
    torch.testing.assert_close(one.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("bits,group", FORMATS)
def test_a_row_gets_the_same_bits_whatever_the_rows_beside_it(kernels, bits, group):
    w = torch.randn(200, 576, generator=torch.Generator().manual_seed(2)) * 0.05  # 200: a partial tile of 16
    layer = quantized_linear(quantized(w, bits, group), kernels=kernels)
    x = rows(40, 576, seed=3)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
    for T in range(2, 41):
        assert torch.equal(layer(x[:T]), alone[:T]), f"{T} rows"
    assert torch.equal(layer(x.flip(0)), alone.flip(0))


@pytest.mark.parametrize("v_group", [32, 16])
def test_int4_and_grouped_int8_fuse_into_one_matrix_of_the_same_values(kernels, v_group):
    """A GGUF layer's Q4_K q and k beside its Q6_K (groups of 16) or Q8_0 (32) v: fused, all three
    become int8 in the smallest group, with the same weights. In groups of 32 each part keeps the bits
    it had alone (int4's offset z - 8 s is the one its kernel computes); in groups of 16 a block's two
    halves are scaled apart, so the int4 parts round differently, by a few ulps."""
    g = torch.Generator().manual_seed(4)
    parts = [quantize_int4(torch.randn(64, 256, generator=g) * 0.05, 32),
             quantize_int4(torch.randn(32, 256, generator=g) * 0.05, 64),
             quantize_grouped_int8(torch.randn(32, 256, generator=g) * 0.05, v_group)]
    fused = cat_rows(parts)
    assert fused.group_size == v_group and fused.codes.shape == (128, 256)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = rows(5, 256, seed=6)
    alone = torch.cat([quantized_linear(p, kernels=kernels)(x) for p in parts], dim=1)
    out = quantized_linear(fused, kernels=kernels)(x)
    if v_group == 32:
        assert torch.equal(out, alone)
    else:
        assert torch.equal(out[:, 96:], alone[:, 96:])
        torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-5)


def superblock_weight(N: int, K: int, group: int, seed: int, centered: bool = False, bits: int = 6) -> SuperblockInt8Weight:
    """Q5_K-like: 6-bit codes (bits 5: as Q5_K runs), scale d * sc with an fp16 d per 256 inputs and an
    int8 sc per group, offset m * mc; the offsets' factor and multipliers drawn apart, so a swap would
    show. `centered`: Q6_K-like, offset -32 d * sc; bits 4: Q4_K-like."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(N, K // 256, generator=g) * 1e-3).half().float()
    m = -32 * d if centered else (torch.randn(N, K // 256, generator=g) * 1e-2).half().float()
    multipliers = torch.randint(-128, 128, (N, K // group, 2), generator=g, dtype=torch.int8)
    if centered:
        multipliers[..., 1] = multipliers[..., 0]
    codes = torch.randint(0, 2**bits, (N, K), generator=g, dtype=torch.uint8)
    return SuperblockInt8Weight(codes, torch.stack((d, m), -1), multipliers, group, bits)


@pytest.mark.parametrize("group, centered, bits", [(16, False, 6), (32, False, 6), (16, True, 6), (32, False, 4),
                                                   (32, False, 5)])
def test_superblock_scales_multiply_as_their_fp32_products_do(kernels, portable, group, centered, bits):
    """Scales kept as fp16 factors times int8 multipliers (a GGUF file's Q5_K, over 5-bit codes; Q6_K's
    centered, its offset -32 times its scale; Q4_K's over 4-bit codes) over 4- to 6-bit codes give the bits of the
    same matrix with 8-bit codes and the products stored as fp32 scales, in every tier, in the bytes
    the file takes (but for a byte a multiplier)."""
    weight = superblock_weight(200, 512, group, seed=group, centered=centered, bits=bits)
    layer = quantized_linear(weight, kernels=kernels)
    plain = quantized_linear(weight.grouped(), kernels=kernels)
    assert layer.superblock_scales and not plain.superblock_scales and layer.centered == centered
    assert (layer.bits, plain.bits) == (bits, 8) and layer.packed.numel() * 8 == plain.packed.numel() * bits
    pairs = 1 if centered else 2  # per superblock and lane: fp16 factors, an int8 multiplier per group
    assert layer.scales_zeros.numel() == 13 * 2 * 16 * pairs * (2 + 256 // group)
    rows_back = torch.tensor([0, 15, 16, 199, 77])
    assert torch.equal(layer.dequantize(rows_back), weight.dequantize(rows_back))
    for T in (1, 2, 4, 5, 9):
        x = rows(T, 512, seed=T)
        out = layer(x)
        assert torch.equal(out, plain(x)), f"{T} rows"
        assert torch.equal(out, quantized_linear(weight, kernels=portable)(x)), f"{T} rows"
    assert out.abs().max() > 0


def assert_runs_as(layer, weight, same_bits, portable, rows_back: torch.Tensor) -> None:
    """`layer` reads back `weight`'s values at `rows_back`, and gives the bits of `same_bits` (the
    same matrix in another form) and of `weight` on the portable tier, for 1 to 17 rows."""
    assert torch.equal(layer.dequantize(rows_back), weight.dequantize(rows_back))
    for T in (1, 3, 9, 17):
        x = rows(T, 256, seed=T)
        out = layer(x)
        assert torch.equal(out, same_bits(x)), f"{T} rows"
        assert torch.equal(out, quantized_linear(weight, kernels=portable)(x)), f"{T} rows"


def test_q5_0_runs_as_its_five_bit_codes_with_one_scale_a_group(kernels, portable):
    """Offsets -16 times the scales over 5-bit codes (a GGUF file's Q5_0) run as those codes in 5 bits
    with one scale a group: the values of the 8-bit form, the bits of the same codes as 8-bit codes
    with fp32 pairs, in every tier, in 5.5 bits a weight (the file's: an fp16 scale) instead of 10."""
    g = torch.Generator().manual_seed(4)
    scales = (torch.rand(72, 256 // 32, generator=g) * 1e-2).half().float()
    weight = GroupedInt8Weight(torch.randint(0, 32, (72, 256), generator=g, dtype=torch.uint8), scales, -16 * scales, 32)
    layer = quantized_linear(weight, kernels=kernels)
    assert (layer.bits, layer.centered) == (5, True)
    assert layer.weight_bytes == 80 * 256 * (5 / 8 + 2 / 32)  # 72 features padded to whole tiles of 16
    pairs = IntegerLinear.from_codes(weight.codes, torch.stack((scales, -16 * scales), -1), 8, 32, kernels)
    assert_runs_as(layer, weight, pairs, portable, torch.tensor([0, 15, 16, 71, 40]))
    # Other offsets (Q8_0's -128 d, a minimum's) keep 8-bit codes.
    assert quantized_linear(GroupedInt8Weight(weight.codes, scales, -128 * scales, 32), kernels=kernels).bits == 8
    assert quantized_linear(GroupedInt8Weight(weight.codes, scales, scales * 0.3, 32), kernels=kernels).bits == 8
    # Scales fp16 does not hold (not a GGUF file's) keep their fp32 pairs: the same values, in 10 bits.
    finer = scales + 1e-7
    assert GroupedInt8Weight(weight.codes, finer, -16 * finer, 32).centered_five() is None


def test_q8_0_runs_as_its_codes_with_one_scale_a_group(kernels, portable):
    """Offsets -k times the scales for a whole k (a GGUF file's Q8_0: k = 128; Q5_0 fused beside it:
    16) run as the codes plus 128 - k with one fp16 scale a group (the file's) and the offset -128
    times it: the values of the 8-bit form, the bits of the same codes with fp32 pairs, in every
    tier, in 8.5 bits a weight, as the file holds them, instead of 10. An all-zero group (scale 0)
    fits; a minimum (Q5_1's) does not, nor scales that fp16 does not hold."""
    g = torch.Generator().manual_seed(5)
    scales = (torch.rand(72, 256 // 32, generator=g) * 1e-2).half().float()
    scales[5, 2] = 0.0
    k = torch.where(torch.arange(72)[:, None] < 40, 128.0, 16.0).expand(72, 8)  # Q8_0 rows, then Q5_0 rows
    codes = torch.randint(0, 256, (72, 256), generator=g, dtype=torch.uint8)
    codes[40:] %= 32
    weight = GroupedInt8Weight(codes, scales, -k * scales, 32)
    layer = quantized_linear(weight, kernels=kernels)
    assert (layer.bits, layer.group_size, layer.centered) == (8, 32, True)
    assert layer.weight_bytes == 80 * 256 * (1 + 2 / 32)  # 72 features padded to whole tiles of 16
    shifted = (codes.to(torch.int16) + (128 - k).to(torch.int16).repeat_interleave(32, 1)).to(torch.uint8)
    pairs = IntegerLinear.from_codes(shifted, torch.stack((scales, -128 * scales), -1), 8, 32, kernels)
    assert_runs_as(layer, weight, pairs, portable, torch.tensor([0, 15, 16, 39, 40, 71]))
    minimum = GroupedInt8Weight(codes, scales, scales * 0.3, 32)
    assert minimum.centered_eight() is None and not quantized_linear(minimum, kernels=kernels).centered
    finer = scales + 1e-7
    assert GroupedInt8Weight(codes, finer, -k * finer, 32).centered_eight() is None
    with pytest.raises(ValueError, match="fp16 values"):
        IntegerLinear.from_centered(shifted, finer, kernels, bits=8)
    # fp32 scales in the centered shape (packed before fp16 scales) are refused, not read as pairs.
    with pytest.raises(RuntimeError, match="8-bit codes take an fp32 scale and offset"):
        kernels.integer_linear(rows(2, 256, seed=0), layer.packed, layer.scales_zeros.float(), 72, 8, 32)
    codes[41, 0] = 200  # in a row with k = 16: above 255 once shifted by 112
    assert GroupedInt8Weight(codes, scales, -k * scales, 32).centered_eight() is None


def test_superblock_scales_refuse_codes_of_more_than_six_bits(kernels):
    weight = superblock_weight(16, 256, 16, seed=1)
    weight.codes[3, 7] = 64
    with pytest.raises(ValueError, match="below 64"):
        quantized_linear(weight, kernels=kernels)


def test_superblock_scales_fuse_as_their_own_format_or_as_grouped_int8(kernels):
    """Q6_K q, k and v stay factored when fused; Q4_K q and k beside Q6_K v become 6-bit codes with
    superblock scales in groups of 16; beside int4 they become fp32-scaled grouped int8. Each part's
    outputs keep their bits."""
    parts = [superblock_weight(32, 256, 16, seed=s) for s in range(3)]
    fused = cat_rows(parts)
    assert isinstance(fused, SuperblockInt8Weight)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = rows(3, 256, seed=7)
    alone = quantized_linear(parts[0], kernels=kernels)(x)
    q4_k = superblock_weight(48, 256, 32, seed=5, bits=4)
    k_quants = cat_rows([q4_k, parts[0]])
    assert isinstance(k_quants, SuperblockInt8Weight) and (k_quants.group_size, k_quants.bits) == (16, 6)
    assert torch.equal(k_quants.dequantize(), torch.cat([q4_k.dequantize(), parts[0].dequantize()]))
    out = quantized_linear(k_quants, kernels=kernels)(x)
    assert torch.equal(out[:, 48:], alone)
    torch.testing.assert_close(out[:, :48], quantized_linear(q4_k, kernels=kernels)(x), rtol=1e-5, atol=1e-5)
    mixed = cat_rows([quantize_int4(torch.randn(32, 256, generator=torch.Generator().manual_seed(9)) * 0.05, 32),
                      parts[0]])
    assert not isinstance(mixed, SuperblockInt8Weight) and mixed.group_size == 16
    assert torch.equal(quantized_linear(mixed, kernels=kernels)(x)[:, 32:], alone)


def test_a_matrix_whose_inputs_do_not_split_into_blocks_stays_on_aten(kernels):
    from specee.model.quantize import Int8Linear

    layer = quantized_linear(quantize_int8(torch.randn(8, 112)), kernels=kernels)
    assert isinstance(layer, Int8Linear)


def attention_inputs(T: int, past: int, seed: int = 0, head_dim: int = 64):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(3, 256, head_dim, generator=g), torch.randn(3, 256, head_dim, generator=g)
    return torch.randn(T, 9, head_dim, generator=g), keys, values


NO_MASK = torch.empty(0, dtype=torch.uint8)
SCALE = 64 ** -0.5


def test_a_sliding_row_sees_its_last_window_keys_and_the_scale_is_applied(kernels):
    """window > 0: a causal row attends to its last `window` keys, a tree row to the last `window`
    of the keys its mask shows (the prefix's last ones, then its ancestors), as a row alone over
    exactly those keys; the scale multiplies q . k."""
    past, T, window = 60, 6, 9
    q, keys, values = attention_inputs(T, past, seed=2)
    visible = torch.arange(past + 1, past + T + 1)
    out = kernels.attention(q, keys, values, visible, NO_MASK, 0, past + T, window, 0.3)
    for t in range(T):
        S = past + t + 1
        expected = F.scaled_dot_product_attention(q[t].view(3, 3, 64)[None], keys[None, :, S - window:S],
                                                  values[None, :, S - window:S], scale=0.3)
        torch.testing.assert_close(out[t], expected.reshape(-1), rtol=1e-5, atol=1e-5)
    chain = torch.tril(torch.ones(T, T, dtype=torch.uint8))
    chain[:, 1] = 0  # a path that skips a node: the window counts the keys each row sees
    chain.fill_diagonal_(1)
    tree = kernels.attention(q, keys, values, torch.empty(0, dtype=torch.long), chain, past, past + T, window, 0.3)
    for t in range(T):
        index = torch.cat((torch.arange(past), past + chain[t].nonzero().flatten()))[-window:]
        expected = F.scaled_dot_product_attention(q[t].view(3, 3, 64)[None], keys[None][:, :, index],
                                                  values[None][:, :, index], scale=0.3)
        torch.testing.assert_close(tree[t], expected.reshape(-1), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, kernels.attention(q, keys, values, visible, NO_MASK, 0, past + T, 0, 0.3))


# Head sizes whose value rows the kernel sums in one sweep of registers, in several (256), and in
# sweeps that end short of a full one (80: 5 chunks of 16, a sweep of 4 or 2 then 1); fp32 and half caches.
@pytest.mark.parametrize("head_dim", [64, 80, 256])
@pytest.mark.parametrize("half", [False, True], ids=["fp32", "fp16"])
def test_attention_equals_pytorch_and_each_row_alone(kernels, head_dim, half):
    past, T = 100, 13
    q, keys, values = attention_inputs(T, past, head_dim=head_dim)
    if half:
        keys, values = keys.half(), values.half()
    visible = torch.arange(past + 1, past + T + 1)
    scale = head_dim ** -0.5
    out = kernels.attention(q, keys, values, visible, NO_MASK, 0, past + T, 0, scale)
    for t in range(T):
        S = past + t + 1
        expected = F.scaled_dot_product_attention(q[t].view(3, 3, head_dim)[None], keys[None, :, :S].float(),
                                                  values[None, :, :S].float())
        torch.testing.assert_close(out[t], expected.reshape(-1), rtol=1e-5, atol=1e-5)
        alone = kernels.attention(q[t:t + 1].contiguous(), keys, values, visible[t:t + 1], NO_MASK, 0, S, 0, scale)
        assert torch.equal(alone[0], out[t]), f"row {t}"


# A short prefix; one several blocks of keys long (a half cache widens 64 keys at a time), not a
# multiple of 16; the same with a sliding window, whose rows' keys start past the prefix's first.
@pytest.mark.parametrize("past, window", [(50, 0), (150, 0), (150, 100)])
@pytest.mark.parametrize("half", [False, True], ids=["fp32", "fp16"])
def test_a_tree_row_attends_as_it_would_after_its_path_was_compacted(kernels, past, window, half):
    """A tree's row sees the prefix and its ancestors, scattered among the draft's slots; after
    acceptance the path is compacted next to the prefix. Both must give the same bits, on either
    cache."""
    T = 16
    q, keys, values = attention_inputs(T, past, seed=1)
    if half:
        keys, values = keys.half(), values.half()
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=torch.Generator().manual_seed(i))) for i in range(1, T)]
    mask = torch.zeros(T, T, dtype=torch.uint8)
    for i in range(T):
        node = i
        while node >= 0:
            mask[i, node] = 1
            node = parents[node]
    assert mask.sum(1).max() > 2, "the tree must have paths deeper than one node"
    out = kernels.attention(q, keys, values, torch.empty(0, dtype=torch.long), mask, past, past + T, window, SCALE)
    for i in range(T):
        index = torch.cat((torch.arange(past), past + mask[i].nonzero().flatten()))
        compact_k, compact_v = torch.zeros_like(keys), torch.zeros_like(values)
        compact_k[:, :len(index)], compact_v[:, :len(index)] = keys[:, index], values[:, index]
        alone = kernels.attention(q[i:i + 1].contiguous(), compact_k, compact_v, torch.tensor([len(index)]), NO_MASK, 0,
                                  len(index), window, SCALE)
        assert torch.equal(alone[0], out[i]), f"row {i}"


def test_rotate_and_store_rounds_as_pytorch_rope_and_writes_the_cache(kernels):
    T, heads, kv_heads, hd, start = 5, 4, 2, 32, 7
    qkv = rows(T, (heads + 2 * kv_heads) * hd, seed=4)
    angles = rope_angles(1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd), torch.arange(start, start + T),
                         torch.float32)
    keys, values = torch.zeros(kv_heads, 16, hd), torch.zeros(kv_heads, 16, hd)
    q = kernels.rotate_and_store(qkv, angles.cos.reshape(T, hd), angles.sin.reshape(T, hd), keys, values, start, heads)
    qk = apply_rope(qkv[:, : (heads + kv_heads) * hd].view(T, heads + kv_heads, hd), angles)
    assert torch.equal(q, qk[:, :heads])
    assert torch.equal(keys[:, start:start + T], qk[:, heads:].transpose(0, 1))
    assert torch.equal(values[:, start:start + T], qkv[:, (heads + kv_heads) * hd:].view(T, kv_heads, hd).transpose(0, 1))
    assert not keys[:, :start].any() and not keys[:, start + T:].any()


def test_norm_and_gate_equal_pytorch_and_each_row_alone(kernels):
    import torch.nn.functional as F

    x, weight = rows(7, 576, seed=3), torch.randn(576, generator=torch.Generator().manual_seed(4))
    normed = kernels.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(normed, F.rms_norm(x, (576,), weight, 1e-5), rtol=1e-5, atol=1e-5)
    gate_up = rows(7, 2 * 1536, seed=5)
    gated = kernels.silu_mul(gate_up)
    torch.testing.assert_close(gated, F.silu(gate_up[:, :1536]) * gate_up[:, 1536:], rtol=1e-5, atol=1e-5)
    geglu = kernels.gelu_mul(gate_up)
    torch.testing.assert_close(geglu, F.gelu(gate_up[:, :1536], approximate="tanh") * gate_up[:, 1536:], rtol=1e-5,
                               atol=1e-5)
    for t in range(7):
        assert torch.equal(kernels.rms_norm(x[t:t + 1].contiguous(), weight, 1e-5), normed[t:t + 1])
        assert torch.equal(kernels.silu_mul(gate_up[t:t + 1].contiguous()), gated[t:t + 1])
        assert torch.equal(kernels.gelu_mul(gate_up[t:t + 1].contiguous()), geglu[t:t + 1])


def run_python(code: str, cwd=None, **env) -> subprocess.CompletedProcess:
    """`code` in a new process that imports the checkout under test, whatever is installed."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env}, cwd=cwd)


def test_a_second_process_reuses_the_built_kernels_from_any_working_directory_and_copy(tmp_path):
    """Another working directory, another copy of the same sources (a fresh clone, a reinstall), and
    a cache folder whose kernels are a link to these (a test's own cache)."""
    import shutil

    assert cpu_kernels() is not None, "the CPU kernels must build on the test machines (g++)"
    bindings = next(bindings_directory().glob("*.so"))
    library = tier_library(tier_named(supported_tiers()[0]))
    built_at = bindings.stat().st_mtime_ns, library.stat().st_mtime_ns
    log = (bindings_directory() / ".ninja_log").read_text()
    clone = tmp_path / "clone"
    shutil.copytree(ROOT / "specee", clone / "specee", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import specee.model.kernels as k; assert k.cpu_kernels() is not None; print(k.__file__); "
            "print(k.bindings_directory()); print(k.tier_library(k.tier_named(k.supported_tiers()[0])))")
    done = run_python(code, cwd=tmp_path, SPECEE_CPU_TIER="", PYTHONPATH=str(clone))
    assert done.returncode == 0, done.stderr
    imported, its_bindings, its_library = done.stdout.split()
    assert imported.startswith(str(clone)) and "compiling" not in done.stderr
    assert (its_bindings, its_library) == (str(bindings_directory()), str(library))  # the same builds
    linked = tmp_path / "linked-cache"
    linked.mkdir()
    (linked / "kernels").symlink_to(bindings_directory().parent)
    done = run_python("from specee.model.kernels import cpu_kernels; assert cpu_kernels() is not None", cwd=tmp_path,
                      SPECEE_CPU_TIER="", SPECEE_CACHE=str(linked))
    assert done.returncode == 0 and "compiling" not in done.stderr, done.stderr
    assert (bindings.stat().st_mtime_ns, library.stat().st_mtime_ns) == built_at
    assert (bindings_directory() / ".ninja_log").read_text() == log  # ninja ran no build step


@pytest.mark.slow  # a tier's build, about 30 s on two cores
def test_processes_that_need_a_tier_at_once_build_it_once(tmp_path):
    """Two processes on a cache without the tier (test workers, a server and a command): one builds,
    the other waits and loads that build; none replaces the library under the other."""
    # The tier quickest to compile (AVX2's: a quarter of the portable one's time); it need not run here.
    quickest = "avx2" if kernels_module.machine() == "x86_64" else "portable"
    code = ("import os; from specee.model.kernels import tier_library, tier_named; "
            f"library = tier_library(tier_named({quickest!r})); print(library, os.stat(library).st_ino)")
    env = {**os.environ, "SPECEE_CACHE": str(tmp_path), "PYTHONPATH": str(ROOT)}
    children = [subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [child.communicate(timeout=300) for child in children]
    assert all(child.returncode == 0 for child in children), [err for _, err in outputs]
    (library, inode), second = (out.split() for out, _ in outputs)
    assert second == [library, inode] and os.stat(library).st_ino == int(inode)
    assert [p.name for p in Path(library).parent.iterdir() if not p.name.startswith(".")] == [Path(library).name]


def test_the_best_tier_runs_and_is_named_once_on_stderr(tmp_path):
    code = ("import specee.model.kernels as k; a = k.cpu_kernels(); b = k.cpu_kernels(); "
            "assert a is b; print(a.tier)")
    done = run_python(code, cwd=tmp_path, SPECEE_CPU_TIER="")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == supported_tiers()[0]
    assert done.stderr.count("specee: CPU kernels: ") == 1
    assert f"CPU kernels: {supported_tiers()[0]} (" in done.stderr


def test_an_override_forces_a_lower_tier_and_a_tier_the_cpu_lacks_is_refused(tmp_path, monkeypatch):
    done = run_python("import specee.model.kernels as k; print(k.cpu_kernels().tier)", cwd=tmp_path,
                      SPECEE_CPU_TIER="portable")
    assert done.returncode == 0 and done.stdout.strip() == "portable", done.stderr
    monkeypatch.setenv("SPECEE_CPU_TIER", "sse9")
    with pytest.raises(ValueError, match="SPECEE_CPU_TIER: unknown CPU tier 'sse9'"):
        kernels_module.requested_tier()
    monkeypatch.delenv("SPECEE_CPU_TIER")
    foreign = "neon" if kernels_module.machine() == "x86_64" else "avx2"
    with pytest.raises(ValueError, match=f"CPU tier {foreign} needs"):
        load_tier(foreign)


def test_the_command_line_refuses_a_tier_the_cpu_cannot_run(capsys):
    from specee.cli import main

    foreign = "neon" if kernels_module.machine() == "x86_64" else "avx2"
    assert main(["generate", "hi", "--cpu-tier", foreign]) == 2
    assert f"CPU tier {foreign} cannot run on this CPU" in capsys.readouterr().err


def test_without_a_compiler_the_kernels_are_unavailable_with_a_reason(monkeypatch):
    monkeypatch.setattr(kernels_module.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(KernelsUnavailable, match="no C\\+\\+ compiler"):
        kernels_module.compiler()
    kernels_module.bindings.cache_clear()
    try:
        with pytest.raises(KernelsUnavailable, match="no C\\+\\+ compiler"):
            kernels_module.bindings()
    finally:
        kernels_module.bindings.cache_clear()


def test_a_tier_that_fails_to_build_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels_module, "COMMON_FLAGS", kernels_module.COMMON_FLAGS + ("-mno-such-flag",))
    with pytest.raises(KernelsUnavailable, match="building the portable CPU kernels failed"):
        tier_library(tier_named("portable"))


def test_damaged_bindings_are_built_again_with_a_warning(tmp_path, monkeypatch):
    """A corrupt bindings library in the cache folder fails to import; `bindings()` warns, removes
    the folder and builds again (the second build is recorded here, not run: it is the first
    build's code, which the fresh-cache tests time)."""
    import shutil

    assert cpu_kernels() is not None
    built = bindings_directory()
    monkeypatch.setenv("SPECEE_CACHE", str(tmp_path))
    target = bindings_directory()
    assert target.parent.parent == tmp_path
    shutil.copytree(built, target)
    next(target.glob("*.so")).write_bytes(b"not a shared object")
    # The copy's build commands are the original's (the same sources' path): ninja finds nothing to do.
    monkeypatch.setattr(kernels_module, "_binding_sources", lambda directory: built / "src")
    real, calls = kernels_module._compile_bindings, []

    def compile_bindings(directory):
        calls.append(directory.exists())
        return real(directory) if len(calls) == 1 else "built again"

    monkeypatch.setattr(kernels_module, "_compile_bindings", compile_bindings)
    with pytest.warns(UserWarning, match="could not be loaded .*rebuilding"):
        assert kernels_module.bindings.__wrapped__() == "built again"
    assert calls == [True, False]  # the damaged folder was removed before the second build


@pytest.mark.slow
def test_a_damaged_tier_library_is_rebuilt_with_a_warning(tmp_path):
    """A corrupt tier library in the cache folder: the next process warns, builds it again and runs."""
    import shutil

    assert cpu_kernels() is not None
    # The quickest tier to build that this CPU runs: AVX2's takes a few seconds, the portable one's,
    # plain loops the compiler vectorizes, about 20.
    name = "avx2" if "avx2" in supported_tiers() else "portable"
    built = tier_library(tier_named(name)).parent
    # The bindings linked (built through their real path, so not again), the tier's folder copied.
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / bindings_directory().name).symlink_to(bindings_directory().resolve())
    shutil.copytree(built, tmp_path / "kernels" / built.name)
    tier = tmp_path / "kernels" / built.name / f"libspecee_{name}.so"
    tier.write_bytes(b"not a shared object")
    done = run_python("from specee.model.kernels import cpu_kernels; print(cpu_kernels().tier)",
                      SPECEE_CACHE=str(tmp_path), SPECEE_CPU_TIER=name)
    assert done.returncode == 0 and done.stdout.strip().endswith(name), done.stderr
    assert "could not be loaded" in done.stderr and tier.read_bytes()[:4] == b"\x7fELF"


# Every tier against the portable one, bit for bit: integer sums are exact, and every fp32 step after
# them is the same operation in the same order in every tier (kernels.h).

@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (4, 128), (8, 0), (8, 32), (8, 16)])
@pytest.mark.parametrize("shape", [(200, 640), (64, 128), (16, 1536)])
def test_every_tier_multiplies_with_the_portable_tiers_bits(other_tier, portable, bits, group, shape):
    N, K = shape
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(N + K)) * 0.05
    weight = quantized(w, bits, group)
    layer, reference = quantized_linear(weight, kernels=other_tier), quantized_linear(weight, kernels=portable)
    for T in (1, 2, 5, 9):
        x = rows(T, K, seed=T) * (1 + 10 * (torch.arange(K) % 7 == 0))  # some large activations
        x[0, :32] = 0  # a block of zeros: scale 0
        out = layer(x)
        assert torch.equal(out, reference(x)), f"{T} rows"
    assert out.abs().max() > 0


def test_every_tier_attends_with_the_portable_tiers_bits(other_tier, portable):
    past, T = 77, 11  # key counts that are not multiples of 16
    q, keys, values = attention_inputs(T, past, seed=5)
    visible = torch.arange(past + 1, past + T + 1)
    for window in (0, 20):
        assert torch.equal(other_tier.attention(q, keys, values, visible, NO_MASK, 0, past + T, window, SCALE),
                           portable.attention(q, keys, values, visible, NO_MASK, 0, past + T, window, SCALE))
    mask = (torch.rand(T, T, generator=torch.Generator().manual_seed(6)) < 0.5).to(torch.uint8) | torch.eye(T, dtype=torch.uint8)
    for window in (0, 20):
        assert torch.equal(other_tier.attention(q * 30, keys, values, torch.empty(0, dtype=torch.long), mask, past,
                                                past + T, window, SCALE),
                           portable.attention(q * 30, keys, values, torch.empty(0, dtype=torch.long), mask, past,
                                              past + T, window, SCALE))


def test_every_tier_rotates_stores_and_attends_several_sequences_with_the_portable_tiers_bits(other_tier, portable):
    heads, kv_heads, hd = 4, 2, 32
    rows_of = [3, 5]
    qkv = rows(sum(rows_of), (heads + 2 * kv_heads) * hd, seed=7)
    angles = rope_angles(1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd), torch.arange(40, 48), torch.float32)
    cos, sin = angles.cos.reshape(8, hd), angles.sin.reshape(8, hd)
    results = []
    for tier in (other_tier, portable):
        caches = [torch.randn(2, kv_heads, 64, hd, generator=torch.Generator().manual_seed(s)) for s in (8, 9)]
        out = tier.rotate_store_attend(qkv, cos, sin, [c[0] for c in caches], [c[1] for c in caches], [40, 20], rows_of,
                                       [torch.arange(41, 44), torch.empty(0, dtype=torch.long)],
                                       [NO_MASK, torch.tril(torch.ones(5, 5, dtype=torch.uint8))], [0, 20], [43, 25], heads,
                                       12, hd ** -0.5)
        results.append((out, caches))
    (out, caches), (expected, expected_caches) = results
    assert torch.equal(out, expected)
    assert all(torch.equal(a, b) for a, b in zip(caches, expected_caches))


@pytest.mark.parametrize("width", [576, 72])
def test_every_tier_normalizes_and_gates_with_the_portable_tiers_bits(other_tier, portable, width):
    x, weight = rows(5, width, seed=10), torch.randn(width, generator=torch.Generator().manual_seed(11))
    assert torch.equal(other_tier.rms_norm(x, weight, 1e-6), portable.rms_norm(x, weight, 1e-6))
    gate_up = torch.linspace(-100, 100, 5 * 2 * width).view(5, 2 * width)  # exp's clamps at both ends
    gate_up = gate_up[:, torch.randperm(2 * width, generator=torch.Generator().manual_seed(12))].contiguous()
    gated = other_tier.silu_mul(gate_up)
    assert torch.equal(gated, portable.silu_mul(gate_up))
    torch.testing.assert_close(gated, F.silu(gate_up[:, :width]) * gate_up[:, width:], rtol=1e-5, atol=1e-5)
    geglu = other_tier.gelu_mul(gate_up)
    assert torch.equal(geglu, portable.gelu_mul(gate_up))
    torch.testing.assert_close(geglu, F.gelu(gate_up[:, :width], approximate="tanh") * gate_up[:, width:], rtol=1e-5,
                               atol=1e-5)
