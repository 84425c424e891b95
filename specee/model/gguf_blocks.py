"""A GGUF tensor's quantized blocks decoded, with vectorised numpy, into affine codes: unsigned codes
with a scale and an offset per group of weights,

    w[n, k] = codes[n, k] * scales[n, k // group_size] + offsets[n, k // group_size],

read from the blocks' own fields, never through a dequantized fp32 matrix.

| type | file's formula                        | codes          | scale   | offset     | group |
|------|---------------------------------------|----------------|---------|------------|-------|
| Q4_0 | d * (q - 8)                           | q, 4 bits      | d       | -8 d       | 32    |
| Q4_1 | d * q + m                             | q, 4 bits      | d       | m          | 32    |
| Q4_K | d * sc * q - dmin * mn                | q, 4 bits      | d sc    | -(dmin mn) | 32    |
| Q5_0 | d * (q - 16)                          | q (0..31), 8   | d       | -16 d      | 32    |
| Q5_1 | d * q + m                             | q (0..31), 8   | d       | m          | 32    |
| Q5_K | d * sc * q - dmin * mn                | q (0..31), 8   | d sc    | -(dmin mn) | 32    |
| Q6_K | d * sc * (q - 32), sc an int8         | q (0..63), 8   | d sc    | -32 d sc   | 16    |
| Q8_0 | d * q, q an int8                      | q + 128, 8     | d       | -128 d     | 32    |

d, m and dmin are fp16 (11 significant bits); the K-quants' sub-scales sc and mins mn are 6-bit,
Q6_K's sc are int8 (at most 7 significant bits). Every scale and offset is one of these fp16 fields
times such an integer (and a power of two), so it has at most 18 significant bits and is exact in
fp32 (24): no rounding. codes * scale is exact in fp32 too (at most 24 bits: Q6_K's 6-bit code
times its 18-bit scale), and so are gguf-py's and llama.cpp's own products, for the same reason:
`AffineCodes.dequantize_rows` and they all round at most once, in the formula's addition, the same
exact value, and agree bit for bit (a zero may differ in sign).

The layouts follow llama.cpp's block_q*_* structs, as gguf-py's quants.py reads them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Type

# Rows decoded at a time: bounds the temporaries (a 128k x 4096 embedding at once would need
# several 0.5 GB ones).
ROWS_PER_CHUNK = 1024


@dataclass(frozen=True)
class AffineCodes:
    """w = codes * scale + offset, one scale and offset per `group_size` consecutive weights of a row."""

    codes: np.ndarray  # uint8 [N, K], < 2**bits
    scales: np.ndarray  # float32 [N, K // group_size]
    offsets: np.ndarray  # float32 [N, K // group_size]
    bits: int  # 4, or 8 for the 5-, 6- and 8-bit codes
    group_size: int
    # The K-quants' scales and offsets factored as the file keeps them (Q4_K, Q5_K, Q6_K; else None):
    # scales = factors[n, s, 0] * multipliers[n, g, 0], offsets = factors[n, s, 1] * multipliers[n, g, 1]
    # for group g of superblock s (256 weights), exact products.
    factors: np.ndarray | None = None  # float32 [N, K // 256, 2]
    multipliers: np.ndarray | None = None  # int8 [N, K // group_size, 2]

    def dequantize_rows(self, rows) -> np.ndarray:
        """The weights of `rows` (an index, a slice or an index array) as float32 [*rows' shape, K]:
        equal to the file's dequantized values (see the module's docstring)."""
        codes = self.codes[rows]  # [..., K]
        lead = codes.shape[:-1]
        grouped = codes.reshape(*lead, -1, self.group_size).astype(np.float32)  # [..., K / g, g]
        weights = grouped * self.scales[rows][..., None] + self.offsets[rows][..., None]
        return weights.reshape(*lead, -1)


# A decoder fills a chunk's outputs from its blocks:
# (blocks [n, n_blocks, type_size], codes [n, n_blocks, block_size], scales, offsets [n, n_blocks, groups]).
Decoder = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]
# A K-quant's scale factors: (blocks, factors [n, n_blocks, 2], multipliers [n, n_blocks, groups, 2]).
Factorer = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


@dataclass(frozen=True)
class _Format:
    bits: int
    group_size: int
    decode_blocks: Decoder
    factor_blocks: Factorer | None = None


def decode(data: np.ndarray, qtype: Type) -> AffineCodes:
    """A quantized tensor's raw bytes, uint8 [N, bytes per row] as `gguf.GGUFReader` gives them
    (read-only or memory-mapped: only one chunk of rows is read at a time), as affine codes."""
    fmt = _FORMATS.get(qtype)
    if fmt is None:
        supported = ", ".join(t.name for t in _FORMATS)
        raise ValueError(f"no affine decoder for GGUF type {_type_name(qtype)}; supported: {supported}")
    qtype = Type(qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    data = np.asarray(data)
    _check_rows(data, qtype.name, block_size, type_size)
    n_rows, n_blocks = data.shape[0], data.shape[1] // type_size
    groups = block_size // fmt.group_size
    # Filled a chunk at a time through views: a chunk of these C-contiguous arrays reshapes in place.
    codes = np.empty((n_rows, n_blocks, block_size), np.uint8)
    scales = np.empty((n_rows, n_blocks, groups), np.float32)
    offsets = np.empty((n_rows, n_blocks, groups), np.float32)
    factored = fmt.factor_blocks is not None
    factors = np.empty((n_rows, n_blocks, 2), np.float32) if factored else None
    multipliers = np.empty((n_rows, n_blocks, groups, 2), np.int8) if factored else None
    for start in range(0, n_rows, ROWS_PER_CHUNK):
        rows = slice(start, min(start + ROWS_PER_CHUNK, n_rows))
        blocks = data[rows].reshape(rows.stop - start, n_blocks, type_size)
        fmt.decode_blocks(blocks, codes[rows], scales[rows], offsets[rows])
        if factored:
            fmt.factor_blocks(blocks, factors[rows], multipliers[rows])
    n_groups = n_blocks * groups
    return AffineCodes(codes.reshape(n_rows, n_blocks * block_size), scales.reshape(n_rows, n_groups),
                       offsets.reshape(n_rows, n_groups), fmt.bits, fmt.group_size, factors,
                       None if multipliers is None else multipliers.reshape(n_rows, n_groups, 2))


def _type_name(qtype) -> str:
    try:
        return Type(qtype).name
    except ValueError:
        return repr(qtype)


def _check_rows(data: np.ndarray, name: str, block_size: int, type_size: int) -> None:
    if data.dtype != np.uint8 or data.ndim != 2:
        raise ValueError(f"a {name} tensor's data must be its raw bytes, uint8 [rows, bytes per row]; "
                         f"got {data.dtype} {list(data.shape)}")
    if data.shape[1] % type_size:
        raise ValueError(f"a {name} row of {data.shape[1]} bytes is not a whole number of {type_size}-byte "
                         f"blocks ({block_size} weights each)")


def _fp16(pairs: np.ndarray) -> np.ndarray:
    """[..., 2] bytes (little-endian fp16) -> [...] float32."""
    return np.ascontiguousarray(pairs).view(np.float16)[..., 0].astype(np.float32)


def _unpack_nibbles(packed: np.ndarray, out: np.ndarray) -> None:
    """packed [..., m] -> out [..., 2, m]: the low nibbles, then the high ones."""
    np.bitwise_and(packed, 0x0F, out=out[..., 0, :])
    np.right_shift(packed, 4, out=out[..., 1, :])


def _add_fifth_bits(qh: np.ndarray, codes: np.ndarray) -> None:
    """Q5_0, Q5_1: bit i of the little-endian 32-bit qh [..., 4] is bit 4 of code i of codes [..., 32]."""
    high = np.unpackbits(qh, axis=-1, bitorder="little")  # [..., 32]
    high <<= 4
    codes |= high


def _q4_0(blocks, codes, scales, offsets):
    # Block: fp16 d, 16 bytes; byte j holds code j (low nibble) and code j + 16 (high).
    d = _fp16(blocks[..., 0:2])
    _unpack_nibbles(blocks[..., 2:18], codes.reshape(*codes.shape[:-1], 2, 16))
    scales[..., 0] = d
    offsets[..., 0] = -8 * d


def _q4_1(blocks, codes, scales, offsets):
    # Block: fp16 d, fp16 m, then Q4_0's 16 bytes.
    _unpack_nibbles(blocks[..., 4:20], codes.reshape(*codes.shape[:-1], 2, 16))
    scales[..., 0] = _fp16(blocks[..., 0:2])
    offsets[..., 0] = _fp16(blocks[..., 2:4])


def _q5_0(blocks, codes, scales, offsets):
    # Block: fp16 d, 4 bytes of fifth bits, then Q4_0's 16 bytes of low nibbles.
    d = _fp16(blocks[..., 0:2])
    _unpack_nibbles(blocks[..., 6:22], codes.reshape(*codes.shape[:-1], 2, 16))
    _add_fifth_bits(blocks[..., 2:6], codes)
    scales[..., 0] = d
    offsets[..., 0] = -16 * d


def _q5_1(blocks, codes, scales, offsets):
    # Block: fp16 d, fp16 m, 4 bytes of fifth bits, 16 bytes of low nibbles.
    _unpack_nibbles(blocks[..., 8:24], codes.reshape(*codes.shape[:-1], 2, 16))
    _add_fifth_bits(blocks[..., 4:8], codes)
    scales[..., 0] = _fp16(blocks[..., 0:2])
    offsets[..., 0] = _fp16(blocks[..., 2:4])


def _q8_0(blocks, codes, scales, offsets):
    # Block: fp16 d, 32 int8; q + 128 is the byte with its top bit flipped.
    d = _fp16(blocks[..., 0:2])
    np.bitwise_xor(blocks[..., 2:34], 0x80, out=codes)
    scales[..., 0] = d
    offsets[..., 0] = -128 * d


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K, Q5_K: 12 bytes -> the 6-bit scales and mins of 8 sub-blocks, [..., 8] each (llama.cpp's
    get_scale_min_k4). Bytes 0-3 hold scales 0-3, bytes 4-7 mins 0-3, each in their low 6 bits;
    scales and mins 4-7 have their low 4 bits in bytes 8-11 (low, high nibble) and their top 2
    bits in the top 2 bits of bytes 0-3 (scales) and 4-7 (mins)."""
    low_scales, low_mins, nibbles = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low_scales & 0x3F, (nibbles & 0x0F) | ((low_scales >> 6) << 4)], axis=-1)
    mins = np.concatenate([low_mins & 0x3F, (nibbles >> 4) | ((low_mins >> 6) << 4)], axis=-1)
    return scales, mins


def _k_scales_offsets(blocks, scales, offsets) -> None:
    """Q4_K, Q5_K: scale d * sc and offset -(dmin * mn) for each sub-block of 32."""
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])
    sub_scales, sub_mins = _k_scales_mins(blocks[..., 4:16])
    np.multiply(d[..., None], sub_scales, out=scales)
    np.multiply(dmin[..., None], sub_mins, out=offsets)
    np.negative(offsets, out=offsets)


def _k_factors(blocks, factors, multipliers) -> None:
    """Q4_K, Q5_K: scale d * sc and offset (-dmin) * mn, as superblock factors and sub-block multipliers."""
    factors[..., 0] = _fp16(blocks[..., 0:2])
    np.negative(_fp16(blocks[..., 2:4]), out=factors[..., 1])
    sub_scales, sub_mins = _k_scales_mins(blocks[..., 4:16])  # 6 bits: valid int8
    multipliers[..., 0], multipliers[..., 1] = sub_scales, sub_mins


def _q4_k(blocks, codes, scales, offsets):
    # Super-block: fp16 d, fp16 dmin, 12 bytes of scales and mins, 128 bytes of codes in 4 chunks of
    # 32: chunk j holds sub-block 2j in its low nibbles and 2j + 1 in its high ones.
    lead = codes.shape[:-1]
    _unpack_nibbles(blocks[..., 16:144].reshape(*lead, 4, 32), codes.reshape(*lead, 4, 2, 32))
    _k_scales_offsets(blocks, scales, offsets)


def _or_high_bits(packed: np.ndarray, codes: np.ndarray, width: int) -> None:
    """Bits 4 and up of codes [..., 8 // width, m] from packed [..., m], which holds 8 // width
    fields of `width` bits a byte: field f of byte l goes to codes[..., f, l]."""
    high = np.empty(codes.shape, np.uint8)
    for field in range(8 // width):
        # Scalar shifts into a buffer: twice as fast as np.unpackbits or a broadcast shift.
        shift = 4 - width * field  # moves the field's lowest bit to bit 4
        if shift >= 0:
            np.left_shift(packed, shift, out=high[..., field, :])
        else:
            np.right_shift(packed, -shift, out=high[..., field, :])
    high &= ((1 << width) - 1) << 4
    codes |= high


def _q5_k(blocks, codes, scales, offsets):
    # Super-block: Q4_K's first 16 bytes, 32 bytes qh, 128 bytes of low nibbles laid out as Q4_K's:
    # bit s of qh[l] is bit 4 of code l of sub-block s.
    lead = codes.shape[:-1]
    _unpack_nibbles(blocks[..., 48:176].reshape(*lead, 4, 32), codes.reshape(*lead, 4, 2, 32))
    _or_high_bits(blocks[..., 16:48], codes.reshape(*lead, 8, 32), width=1)
    _k_scales_offsets(blocks, scales, offsets)


def _q6_k(blocks, codes, scales, offsets):
    # Super-block: 128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d. Each half of 128 codes takes
    # 64 bytes of ql (low nibbles: codes 0-63, high: 64-127) and 32 of qh (bits 2c, 2c + 1 of
    # qh[l] are bits 4-5 of code 32c + l).
    lead = codes.shape[:-1]
    _unpack_nibbles(blocks[..., 0:128].reshape(*lead, 2, 64), codes.reshape(*lead, 2, 2, 64))
    _or_high_bits(blocks[..., 128:192].reshape(*lead, 2, 32), codes.reshape(*lead, 2, 4, 32), width=2)
    d = _fp16(blocks[..., 208:210])
    np.multiply(d[..., None], blocks[..., 192:208].view(np.int8), out=scales)
    np.multiply(scales, -32, out=offsets)


def _q6_k_factors(blocks, factors, multipliers) -> None:
    """Q6_K: scale d * sc and offset (-32 d) * sc."""
    d = _fp16(blocks[..., 208:210])
    factors[..., 0], factors[..., 1] = d, -32 * d
    sub_scales = blocks[..., 192:208].view(np.int8)
    multipliers[..., 0], multipliers[..., 1] = sub_scales, sub_scales


_FORMATS: dict[Type, _Format] = {
    Type.Q4_0: _Format(4, 32, _q4_0),
    Type.Q4_1: _Format(4, 32, _q4_1),
    Type.Q4_K: _Format(4, 32, _q4_k, _k_factors),
    Type.Q5_0: _Format(8, 32, _q5_0),
    Type.Q5_1: _Format(8, 32, _q5_1),
    Type.Q5_K: _Format(8, 32, _q5_k, _k_factors),
    Type.Q6_K: _Format(8, 16, _q6_k, _q6_k_factors),
    Type.Q8_0: _Format(8, 32, _q8_0),
}
# The types `decode` reads, and the width of their codes (4: two codes a byte; 8: one).
CODE_BITS: dict[Type, int] = {qtype: fmt.bits for qtype, fmt in _FORMATS.items()}
GROUP_SIZES: dict[Type, int] = {qtype: fmt.group_size for qtype, fmt in _FORMATS.items()}
# The types whose scales come factored (AffineCodes.factors).
FACTORED: frozenset[Type] = frozenset(qtype for qtype, fmt in _FORMATS.items() if fmt.factor_blocks is not None)


def factored_code_width(bits: int, group_size: int) -> int:
    """The bits a factored type's codes need (AffineCodes' bits and group size): Q4_K's 4, Q5_K's 5
    (groups of 32), Q6_K's 6 (groups of 16)."""
    return 4 if bits == 4 else 5 if group_size == 32 else 6
