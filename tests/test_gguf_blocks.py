"""GGUF blocks decoded into affine codes give back gguf-py's dequantized weights bit for bit, for
every type decoded.

Why bit for bit, for every type: each scale and offset is an fp16 field (11 significant bits)
times an integer of at most 8 bits, so exact in fp32, and code * scale is exact in fp32 too (at most
24 bits, Q6_K's). gguf-py's own products are exact for the same reason, Q6_K's (d * sc) * (q - 32)
included (18 + 5 bits), so it rounds only where the formula adds (Q4_1, Q5_1, and the K-quants'
minus dmin * m) or not at all. codes * scales + offsets, summed exactly in float64 (all terms lie
within 51 bits of each other) and rounded once to float32, is the same value: equal bit for bit.
The test covers fp16 fields in a realistic range and every finite fp16, subnormals included.
Zeros are compared without their sign: gguf-py's d * 0 is -0.0 for a negative d, where
code * scale + offset gives +0.0.

The blocks are random bytes (every byte pattern is a valid code, sub-scale or packed high bit)
with their fp16 fields overwritten with finite values: the layouts are checked against gguf-py,
not restated here.
"""
import tracemalloc

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Type
from gguf.quants import dequantize

from specee.model import gguf_blocks
from specee.model.gguf_blocks import CODE_BITS, FACTORED, decode

# Byte offsets of each block's fp16 fields (d, then m or dmin), from ggml's block_* structs.
FP16_FIELDS = {
    Type.Q4_0: (0,), Type.Q4_1: (0, 2), Type.Q5_0: (0,), Type.Q5_1: (0, 2), Type.Q8_0: (0,),
    Type.Q4_K: (0, 2), Type.Q5_K: (0, 2), Type.Q6_K: (208,),
}
# bits, group size, and how many code values each type has.
LAYOUT = {
    Type.Q4_0: (4, 32, 16), Type.Q4_1: (4, 32, 16), Type.Q4_K: (4, 32, 16),
    Type.Q5_0: (8, 32, 32), Type.Q5_1: (8, 32, 32), Type.Q5_K: (8, 32, 32),
    Type.Q6_K: (8, 16, 64), Type.Q8_0: (8, 32, 256),
}
TYPES = list(LAYOUT)
ROWS, COLUMNS = 6, 512  # two K-quant super-blocks a row


def random_fp16(rng, shape, fields: str) -> np.ndarray:
    if fields == "realistic":  # magnitudes 1e-4 .. 1e-1, either sign
        magnitude = np.exp(rng.uniform(np.log(1e-4), np.log(1e-1), shape))
        return (magnitude * rng.choice([-1, 1], shape)).astype(np.float16)
    bits = rng.integers(0, 2**16, shape, dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] &= 0x83FF  # inf / NaN exponent cleared: every finite fp16
    bits.flat[:4] = [0x0001, 0x8001, 0x7BFF, 0xFBFF]  # the extremes: +-2**-24 (subnormal), +-65504
    return bits.view(np.float16)


def random_blocks(qtype, rows=ROWS, columns=COLUMNS, fields="realistic", seed=0) -> np.ndarray:
    """A tensor's raw bytes, uint8 [rows, bytes per row], as gguf.GGUFReader gives them."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, columns // block_size * type_size), dtype=np.uint8)
    blocks = data.reshape(rows, -1, type_size)
    for offset in FP16_FIELDS[qtype]:
        values = random_fp16(rng, blocks.shape[:2], fields)
        blocks[..., offset:offset + 2] = values[..., None].view(np.uint8)
    return data


def assert_same_floats(ours: np.ndarray, expected: np.ndarray) -> None:
    """Equal bit for bit, but for the sign of zero (x + 0.0 turns -0.0 into +0.0)."""
    assert ours.dtype == expected.dtype == np.float32
    np.testing.assert_array_equal((ours + np.float32(0)).view(np.uint32), (expected + np.float32(0)).view(np.uint32))


def affine_in_float64(affine) -> np.ndarray:
    rows, columns = affine.codes.shape
    codes = affine.codes.reshape(rows, -1, affine.group_size).astype(np.float64)
    weights = codes * affine.scales[..., None].astype(np.float64) + affine.offsets[..., None]
    return weights.reshape(rows, columns).astype(np.float32)


@pytest.mark.parametrize("fields", ["realistic", "any finite fp16"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_affine_codes_equal_gguf_dequantization(qtype, fields):
    data = random_blocks(qtype, fields=fields)
    expected = dequantize(data, qtype)  # [ROWS, COLUMNS]
    affine = decode(data, qtype)
    assert_same_floats(affine_in_float64(affine), expected)
    assert_same_floats(affine.dequantize_rows(slice(None)), expected)  # float32 arithmetic, same values


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_codes_scales_and_groups_have_the_type_layout(qtype):
    bits, group_size, code_values = LAYOUT[qtype]
    affine = decode(random_blocks(qtype), qtype)
    assert (affine.bits, affine.group_size, CODE_BITS[qtype]) == (bits, group_size, bits)
    assert affine.codes.dtype == np.uint8 and affine.codes.shape == (ROWS, COLUMNS)
    for per_group in (affine.scales, affine.offsets):
        assert per_group.dtype == np.float32 and per_group.shape == (ROWS, COLUMNS // group_size)
    # Random bytes reach both ends of the code range (with this seed; a missing high bit would not).
    assert affine.codes.min() == 0 and affine.codes.max() == code_values - 1


def test_supported_types_are_those_tested():
    assert set(CODE_BITS) == set(LAYOUT)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_k_quant_scales_factor_exactly(qtype):
    """The K-quants' scales and offsets are an fp32 factor per 256 weights times an int8 per
    group, exactly (what the kernels' superblock scales multiply back); the other types have none."""
    affine = decode(random_blocks(qtype), qtype)
    if qtype not in (Type.Q4_K, Type.Q5_K, Type.Q6_K):
        assert qtype not in FACTORED and affine.factors is None and affine.multipliers is None
        return
    assert qtype in FACTORED
    groups = 256 // affine.group_size
    assert affine.factors.dtype == np.float32 and affine.factors.shape == (ROWS, COLUMNS // 256, 2)
    assert affine.multipliers.dtype == np.int8 and affine.multipliers.shape == (ROWS, COLUMNS // affine.group_size, 2)
    products = np.repeat(affine.factors, groups, axis=1) * affine.multipliers.astype(np.float32)
    assert np.array_equal(products[..., 0], affine.scales) and np.array_equal(products[..., 1], affine.offsets)
    assert len(np.unique(affine.multipliers[..., 0])) > 20  # the multipliers vary (a constant one would hide a mix-up)


@pytest.mark.parametrize("qtype", [Type.Q4_K, Type.Q5_0, Type.Q6_K], ids=lambda t: t.name)
def test_read_only_memmap_decoded_in_chunks(qtype, tmp_path, monkeypatch):
    """Chunks of 3 rows over 8: two full chunks and a partial one, from a read-only file mapping."""
    monkeypatch.setattr(gguf_blocks, "ROWS_PER_CHUNK", 3)
    data = random_blocks(qtype, rows=8, seed=1)
    data.tofile(tmp_path / "blocks")
    mapped = np.memmap(tmp_path / "blocks", dtype=np.uint8, mode="r", shape=data.shape)
    assert_same_floats(decode(mapped, qtype).dequantize_rows(slice(None)), dequantize(data, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_temporaries_stay_within_a_chunk(qtype, tmp_path, monkeypatch):
    """Peak memory while decoding is the outputs plus a chunk's temporaries: a copy of the file's
    bytes (an eighth of them, here) or a dequantized fp32 matrix would not fit."""
    monkeypatch.setattr(gguf_blocks, "ROWS_PER_CHUNK", 64)
    rows, columns = 4096, 256
    data = random_blocks(qtype, rows=rows, columns=columns)
    data.tofile(tmp_path / "blocks")
    mapped = np.memmap(tmp_path / "blocks", dtype=np.uint8, mode="r", shape=data.shape)
    group_size = LAYOUT[qtype][1]
    outputs = rows * columns + 2 * 4 * rows * (columns // group_size)  # codes, scales, offsets
    if qtype in FACTORED:  # and the scales' factors and multipliers
        outputs += 2 * 4 * rows * (columns // 256) + 2 * rows * (columns // group_size)
    tracemalloc.start()
    try:
        decode(mapped, qtype)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < outputs + data.nbytes / 8


@pytest.mark.parametrize("qtype", [Type.Q4_K, Type.Q6_K], ids=lambda t: t.name)
def test_dequantize_rows_picks_rows(qtype):
    affine = decode(random_blocks(qtype), qtype)
    every_row = affine.dequantize_rows(slice(None))  # [ROWS, COLUMNS]
    for rows in (2, slice(1, 4), np.array([3, 0, 3]), np.array([[1, 2], [0, 5]])):
        np.testing.assert_array_equal(affine.dequantize_rows(rows), every_row[rows])


def test_qtype_given_as_a_number():
    data = random_blocks(Type.Q4_K)
    np.testing.assert_array_equal(decode(data, int(Type.Q4_K)).codes, decode(data, Type.Q4_K).codes)


def test_row_not_a_whole_number_of_blocks_is_refused():
    with pytest.raises(ValueError, match=r"Q4_K row of 289 bytes is not a whole number of 144-byte blocks"):
        decode(np.zeros((2, 289), np.uint8), Type.Q4_K)
    with pytest.raises(ValueError, match=r"Q8_0 row of 33 bytes"):
        decode(np.zeros((2, 33), np.uint8), Type.Q8_0)


@pytest.mark.parametrize("data", [np.zeros(144, np.uint8), np.zeros((2, 36), np.float32)], ids=["1-D", "float32"])
def test_data_other_than_rows_of_bytes_is_refused(data):
    with pytest.raises(ValueError, match=r"raw bytes, uint8 \[rows, bytes per row\]"):
        decode(data, Type.Q4_K)


def test_unsupported_type_is_named_with_the_supported_ones():
    with pytest.raises(ValueError, match=r"GGUF type Q2_K; supported: Q4_0, Q4_1, Q4_K, .*Q8_0"):
        decode(np.zeros((1, 84), np.uint8), Type.Q2_K)
    with pytest.raises(ValueError, match=r"GGUF type Q2_K; supported"):
        decode(np.zeros((1, 84), np.uint8), int(Type.Q2_K))
