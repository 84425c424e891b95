"""Quantized linears on the CPU kernels: int8 activations (one scale per row and block of 32
inputs, as llama.cpp's Q8 blocks) times the weights' own 4- or 8-bit codes, summed exactly in
int32 per block. A row's output never depends on the other rows of the call, and a pass over
several rows reads each weight once (`kernels/cpu_kernels.cpp`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


LANES = 16  # output features per kernel tile
BLOCK = 32  # inputs per activation block
SUPERBLOCK = 256  # inputs per pair of scale factors (superblock scales)
FACTOR_BYTES = 2  # a superblock's scale factors are fp16 (kernels.h)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] unsigned (below 2 ** bits; bits 4, 5, 6 or 8) -> [N / 16, K / 32 * block bytes]:
    per tile of 16 features and block of 32 inputs, 8 steps of [16 lanes x 4 inputs]; 4-bit codes
    hold steps 0-3 in the low nibbles and 4-7 in the high ones, 5- and 6-bit codes as
    `five_bit_blocks` and `six_bit_blocks` pack them. N is padded to 16 with zeros."""
    N, K = codes.shape
    codes = F.pad(codes.to(torch.uint8), (0, 0, 0, -N % LANES))
    steps = codes.view(-1, LANES, K // BLOCK, 8, 4).permute(0, 2, 3, 1, 4)  # [tiles, blocks, step, lane, 4]
    if bits == 4:
        steps = steps[:, :, :4] | (steps[:, :, 4:] << 4)
    if bits in (5, 6):
        narrow = five_bit_blocks if bits == 5 else six_bit_blocks
        return narrow(steps.reshape(*steps.shape[:2], -1)).reshape(steps.shape[0], -1)
    return steps.reshape(steps.shape[0], -1).contiguous()


def five_bit_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """[..., 512] codes below 32, a byte each -> [..., 320]: 256 bytes whose low nibble is code i's low
    4 bits and whose high nibble is code 256 + i's, then 64 bytes whose bit k is bit 4 of code
    64 k + i (kernels.h's unpack_five reads them)."""
    low = (blocks[..., :256] & 15) | ((blocks[..., 256:] & 15) << 4)
    high = (blocks >> 4).unflatten(-1, (8, 64))  # [..., k, i]: bit 4 of code 64 k + i
    high = sum(high[..., k, :] << k for k in range(8))
    return torch.cat((low, high.to(torch.uint8)), dim=-1)


def five_bit_codes(blocks: torch.Tensor) -> torch.Tensor:
    """five_bit_blocks undone: [..., 320] -> [..., 512]."""
    low, high = blocks[..., :256], blocks[..., 256:]
    highs = torch.stack([(high >> k & 1) << 4 for k in range(8)], dim=-2).flatten(-2)  # [..., 512]
    return torch.cat((low & 15, low >> 4), dim=-1) | highs


def six_bit_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """[..., 512] codes below 64, a byte each -> [..., 384]: 256 bytes whose low nibble is code i's low
    4 bits and whose high nibble is code 256 + i's, then 128 bytes holding bits 4-5 of codes i, 128 + i,
    256 + i and 384 + i, two bits each from the bottom (kernels.h's unpack_six reads them)."""
    low = (blocks[..., :256] & 15) | ((blocks[..., 256:] & 15) << 4)
    high = blocks >> 4
    high = high[..., :128] | (high[..., 128:256] << 2) | (high[..., 256:384] << 4) | (high[..., 384:] << 6)
    return torch.cat((low, high), dim=-1)


def eight_bit_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """six_bit_blocks undone: [..., 384] -> [..., 512]."""
    low, high = blocks[..., :256], blocks[..., 256:]
    highs = [(high >> shift & 3) << 4 for shift in (0, 2, 4, 6)]
    return torch.cat(((low[..., :128] & 15) | highs[0], (low[..., 128:] & 15) | highs[1],
                      (low[..., :128] >> 4) | highs[2], (low[..., 128:] >> 4) | highs[3]), dim=-1)


def fp16_values(values: torch.Tensor) -> bool:
    """Whether every value is an fp16 value (fp16 keeps it exactly)."""
    values = values.float()
    return torch.equal(values.half().float(), values)


def per_tile(values: torch.Tensor) -> torch.Tensor:
    """[N, ...] per-feature values -> [N / 16, ..., 16], padded with zeros."""
    N = values.shape[0]
    padded = F.pad(values, (0, 0) * (values.dim() - 1) + (0, -N % LANES))
    return padded.view(-1, LANES, *values.shape[1:]).movedim(1, -1).contiguous()


class IntegerLinear(nn.Module):
    """A quantized matrix as unsigned codes [N, K] with, for 4 bits, a bf16 scale and zero per
    feature and group of inputs (w = (code - 8) * scale + zero; `scales_zeros` [N, G, 2]) or, for 8
    bits, an fp32 scale and offset per feature (group_size 0: w = code * scale + offset; [N, 2]) or
    per feature and group of 16 or 32 inputs ([N, G, 2]); or 4-, 5- or 6-bit codes whose scales and
    offsets are superblock factors times int8 multipliers (`from_superblocks`). Row lookups (the tied head
    and embedding) read the packed tiles back (`dequantize`)."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, out_features: int, bits: int,
                 group_size: int, kernels, bias: torch.Tensor | None = None) -> None:
        """`packed` and `scales_zeros` already in the kernels' tiles (`from_codes` makes them)."""
        super().__init__()
        self.out_features, self.in_features = out_features, packed.shape[1] // (LANES * bits // 8)
        if self.in_features % BLOCK or (group_size % BLOCK and not (bits in (6, 8) and group_size == BLOCK // 2)):
            raise ValueError(f"in_features {self.in_features} must be a multiple of {BLOCK}, and the group size "
                             f"{group_size} too (or 16 for 6 and 8 bits)")
        records = scales_zeros.dtype == torch.uint8
        records_fit = bits == 6 and group_size or bits in (4, 5) and group_size == BLOCK
        if (records and (self.in_features % SUPERBLOCK or not records_fit) or bits == 6 and not records
                or bits == 5 and not records and (group_size != BLOCK or scales_zeros.dim() != 3)
                or bits == 8 and group_size and scales_zeros.dim() == 3 and group_size != BLOCK):
            raise ValueError("superblock scales are for 6-bit, 5-bit and 4-bit codes (those in groups of 32), over a "
                             "multiple of 256 inputs; 6-bit codes take nothing else; 5-bit codes otherwise, and "
                             "centered 8-bit ones, take one scale per group of 32 ([tiles, G, 16])")
        self.bits, self.group_size, self.kernels, self.bias = bits, group_size, kernels, bias
        self.packed = packed  # [tiles, K / 32 * block bytes] uint8
        self.scales_zeros = scales_zeros  # [tiles, G, 2, 16], [tiles, 2, 16] or superblock records, uint8
        self.weight_bytes = self.packed.numel() + self.scales_zeros.numel() * self.scales_zeros.element_size()

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales_zeros: torch.Tensor, bits: int, group_size: int, kernels,
                   bias: torch.Tensor | None = None) -> "IntegerLinear":
        """codes [N, K] and scales_zeros [N, G, 2] or [N, 2] (see the class), packed into tiles."""
        if codes.shape[1] % BLOCK:
            raise ValueError(f"in_features {codes.shape[1]} must be a multiple of {BLOCK}")
        return cls(pack_codes(codes, bits), per_tile(scales_zeros), codes.shape[0], bits, group_size, kernels, bias)

    @classmethod
    def from_superblocks(cls, codes: torch.Tensor, factors: torch.Tensor, multipliers: torch.Tensor, group_size: int,
                         kernels, bias: torch.Tensor | None = None, bits: int = 6) -> "IntegerLinear":
        """Codes [N, K] below 2 ** bits (6, or 4 or 5 in groups of 32) whose scale and offset are factors
        [N, K / 256, 2] (fp16 values, as a GGUF file's K-quants have them) times multipliers
        [N, K / group_size, 2] int8 (quantize.py's SuperblockInt8Weight), with, per tile and
        superblock of 256 inputs, the factors [2, 16] fp16 then each group's multipliers [2, 16] int8,
        as bytes. Where every offset is -32 times its scale (a GGUF file's Q6_K) and 6-bit codes come
        in groups of 16, a centered record: D [16] fp16, then each group's sc [16] int8."""
        if codes.shape[1] % SUPERBLOCK:
            raise ValueError(f"in_features {codes.shape[1]} must be a multiple of {SUPERBLOCK}")
        if bits not in (4, 5, 6) or (bits in (4, 5) and group_size != BLOCK):
            raise ValueError(f"superblock scales take 6-bit codes, or 4- or 5-bit ones in groups of {BLOCK}")
        if codes.numel() and int(codes.max()) >= 2**bits:
            raise ValueError(f"superblock scales of {bits}-bit codes take codes below {2**bits}; "
                             f"got {int(codes.max())}")
        factors, multipliers = factors.float(), multipliers.to(torch.int8)
        centered = (bits == 6 and group_size == LANES and torch.equal(factors[..., 1], -32 * factors[..., 0])
                    and torch.equal(multipliers[..., 0], multipliers[..., 1]))
        if centered:
            factors, multipliers = factors[..., :1], multipliers[..., :1]
        if not fp16_values(factors):
            raise ValueError("superblock factors must be fp16 values (a GGUF file's K-quant scales are)")
        factors = factors.half()
        tile_factors = per_tile(factors)  # [tiles, S, 2 or 1, 16]
        tile_multipliers = per_tile(multipliers)  # [tiles, G, 2 or 1, 16]
        tiles, superblocks = tile_factors.shape[:2]
        records = torch.cat((tile_factors.reshape(tiles, superblocks, -1).view(torch.uint8),
                             tile_multipliers.reshape(tiles, superblocks, -1).view(torch.uint8)), dim=-1)
        return cls(pack_codes(codes, bits), records.reshape(tiles, -1), codes.shape[0], bits, group_size, kernels, bias)

    @classmethod
    def from_centered(cls, codes: torch.Tensor, scales: torch.Tensor, kernels, bias: torch.Tensor | None = None,
                      bits: int = 5) -> "IntegerLinear":
        """Codes [N, K] below 2 ** bits with w = (code - 2 ** (bits - 1)) * scale, one scale per feature
        and group of 32 ([N, K / 32], fp16 values, as a GGUF file's Q5_0 and Q8_0 have them, kept in
        fp16): 5-bit codes (Q5_0, its own codes) or 8-bit ones (Q8_0, its codes plus 128), one scale
        per group and no offset."""
        if codes.shape[1] % BLOCK:
            raise ValueError(f"in_features {codes.shape[1]} must be a multiple of {BLOCK}")
        if bits not in (5, 8):
            raise ValueError(f"centered codes are 5 or 8 bits; got {bits}")
        if codes.numel() and int(codes.max()) >= 2**bits:
            raise ValueError(f"{bits}-bit codes must be below {2**bits}; got {int(codes.max())}")
        if not fp16_values(scales):
            raise ValueError("centered scales must be fp16 values (a GGUF file's Q5_0 and Q8_0 scales are)")
        return cls(pack_codes(codes, bits), per_tile(scales.half()), codes.shape[0], bits, BLOCK, kernels, bias)

    @property
    def superblock_scales(self) -> bool:
        """Scales stored as superblock records (`from_superblocks`)."""
        return self.scales_zeros.dtype == torch.uint8

    @property
    def centered(self) -> bool:
        """Offsets -16 (5 bits), -32 (6 bits) or -128 (8 bits) times the scales: superblock records of D
        and sc alone (their size says so), or codes with one scale per group."""
        if not self.superblock_scales:
            return self.bits == 5 or self.bits == 8 and self.group_size == BLOCK and self.scales_zeros.dim() == 3
        groups = SUPERBLOCK // self.group_size
        record = self.scales_zeros.shape[1] // (self.in_features // SUPERBLOCK)
        return record == LANES * FACTOR_BYTES + groups * LANES

    def _superblock_scales_offsets(self, tiles: torch.Tensor, lanes: torch.Tensor) -> torch.Tensor:
        """The fp32 scales and offsets [n, G, 2] of the features at (tiles, lanes), from superblock records."""
        groups, pairs = SUPERBLOCK // self.group_size, 1 if self.centered else 2
        factor_bytes = pairs * LANES * FACTOR_BYTES
        records = self.scales_zeros.view(self.scales_zeros.shape[0], -1, factor_bytes + groups * pairs * LANES)[tiles]
        n, superblocks = records.shape[:2]
        factors = records[..., :factor_bytes].contiguous().view(torch.float16).float().view(n, superblocks, pairs, LANES)
        multipliers = records[..., factor_bytes:].contiguous().view(torch.int8)
        multipliers = multipliers.view(n, superblocks, groups, pairs, LANES)
        each = torch.arange(n)
        factors, multipliers = factors[each, ..., lanes], multipliers[each, ..., lanes]  # [n, S, p], [n, S, groups, p]
        if self.centered:  # offset (-32 D) sc, as the kernels compute it
            factors, multipliers = torch.cat((factors, -32 * factors), -1), multipliers.expand(-1, -1, -1, 2)
        return (factors[:, :, None] * multipliers.float()).flatten(1, 2)  # [n, G, 2]

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The weights of `rows` (all when None), fp32 [len(rows), K], read back from the packed tiles:
        the values the kernels multiply by (the plain weight need not be kept for row lookups)."""
        rows = torch.arange(self.out_features) if rows is None else rows.flatten()
        tiles, lanes = rows // LANES, rows % LANES
        blocks = self.in_features // BLOCK
        if self.bits == 4:
            packed = self.packed.view(-1, blocks, 4, LANES, 4)[tiles, :, :, lanes]  # [n, blocks, 4 steps, 4]
            codes = torch.cat((packed & 15, packed >> 4), dim=2)  # steps 0-3 low nibbles, 4-7 high
        elif self.bits in (5, 6):
            undo, size = (five_bit_codes, 320) if self.bits == 5 else (eight_bit_blocks, 384)
            unpacked = undo(self.packed.view(-1, blocks, size)[tiles]).view(len(rows), blocks, 8, LANES, 4)
            codes = unpacked[torch.arange(len(rows)), :, :, lanes]
        else:
            codes = self.packed.view(-1, blocks, 8, LANES, 4)[tiles, :, :, lanes]  # [n, blocks, 8 steps, 4]
        codes = codes.reshape(len(rows), self.in_features).float()
        if self.superblock_scales:
            scales_zeros = self._superblock_scales_offsets(tiles, lanes)  # [n, G, 2]
        elif self.centered:  # one scale per group, the offset -32 or -128 times it
            scales = self.scales_zeros[tiles, :, lanes].float()  # [n, G]
            scales_zeros = torch.stack((scales, -2 ** (self.bits - 1) * scales), dim=-1)
        else:
            scales_zeros = self.scales_zeros[tiles, ..., lanes].float()  # [n, G, 2] or [n, 2]
        if scales_zeros.dim() == 2:  # 8 bits, one scale per row: w = (code - 128) * s (offset -128 s)
            return (codes - 128) * scales_zeros[:, :1]
        scale, zero = scales_zeros[..., 0, None], scales_zeros[..., 1, None]  # [n, G, 1]
        grouped = codes.view(len(rows), -1, self.group_size)
        if self.bits == 4 and not self.superblock_scales:
            return ((grouped - 8) * scale + zero).flatten(1)
        return (grouped * scale + zero).flatten(1)

    def as_kernel_matrix(self):
        """What the kernels' fused decoder layers take of this matrix (`bindings.cpp`, Matrix)."""
        return self.kernels.matrix(self.packed, self.scales_zeros, self.out_features, self.bits, self.group_size, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 and x.dtype == torch.float32 else x.reshape(-1, self.in_features).float()  # [T, K]
        out = self.kernels.integer_linear(rows.contiguous(), self.packed, self.scales_zeros, self.out_features,
                                          self.bits, self.group_size)
        out = out if x.dtype == torch.float32 else out.to(x.dtype)
        if x.dim() != 2:
            out = out.reshape(*x.shape[:-1], -1)
        return out + self.bias if self.bias is not None else out
