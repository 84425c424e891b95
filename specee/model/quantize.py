"""Weight-only int8 and int4 on the CPU: a transform that replaces a built model's linear layers
(and its embedding) by quantized ones, in place, as gpt-fast does.

Formats:
- int8: per-output-channel symmetric, w = code * scale.
- int4: group-wise with zero points along the input features, w = (code - 8) * scale + zero; the
  output head and the embedding stay int8.
- int8 grouped: 8-bit codes with an fp32 scale and offset per group of 16 or 32 inputs, w = code *
  scale + offset: what a GGUF file's Q5_0, Q5_1 and Q8_0 blocks are, exactly (`gguf_blocks.py`);
  CPU kernels only. The K-quants (Q4_K, Q5_K, Q6_K) keep their scales' own structure (an fp32
  factor per 256 inputs times an int8 per group: `SuperblockInt8Weight`) and run as 4- or 6-bit
  codes: the same values in about the file's bytes.

Two ways to run them:
- With the CPU kernels (`kernels/`, the default): `IntegerLinear` rounds each row's activations to
  int8 in blocks of 32 and sums code products exactly in integers, so a row's result never depends
  on the rows beside it, and a pass over 9 rows reads each weight once.
- Without (`compile=False`): aten's `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu`, which
  take bf16 activations and scales; the result is cast back to the model's dtype. Each gives a row
  the same bits whatever the number of rows, and attention then runs each new row alone
  (`Attention.rows_alone`).
Either way speculation is lossless in these formats (README, "Where lossless holds"); norms,
residuals, attention and the KV cache keep the model's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_packing import PackedLinear
from .integer_linear import BLOCK as INPUT_BLOCK, SUPERBLOCK, IntegerLinear, fp16_values
from .fingerprint import weights_fingerprint

QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")
# One more row of a pass, as a fraction of a one-token pass, per CPU tier of the kernels (BENCHMARKS.md,
# "Multi-row cost per format" and "CPU tiers"): the kernels read the weights once for all rows, but
# every row's int8 products cost compute that a one-token pass, bound by reading the weights, does
# not spend. Measured: avx512 (Zen 4), avx2 (Zen 3), portable; the tiers not measured yet take avx2's,
# but amx takes avx512's (its rows' products are no dearer: AVX-512 VNNI for one row, tiles for more).
KERNEL_ROW_COST = {"amx": 0.15, "avx512": 0.15, "avxvnni": 0.2, "avx2": 0.2, "neon": 0.2, "portable": 1.0}
ATEN_ROW_COST = 0.17
# Those were measured on the default model in its default format (the file's own blocks), whose
# row makes 134,479,872 multiply-adds and whose pass reads 96,576,768 bytes. A row costs its
# multiply-adds; a one-row pass, the time to read the weights: a model with fewer multiply-adds per
# byte (Gemma 3 270M: 1.07 against the default's 1.39, its Q8_0 head of 262,144 rows 71% of the
# bytes) pays less for a row, in proportion (BENCHMARKS.md, "Multi-row cost of a 262k vocabulary"). The ratio is kept exact,
# so the default model's price is the measured one to the last bit, never a hair under a threshold.
REFERENCE_MULTIPLY_ADDS_PER_BYTE = 134_479_872 / 96_576_768
INT4_GROUP_SIZES = (32, 64, 128)
# The default model comes as Q4_1 (groups of 32): groups of 32 keep its values almost exactly,
# groups of 64 cannot, and moved its logits far more (BENCHMARKS.md).
DEFAULT_INT4_GROUP_SIZE = 32
KERNEL_DTYPE = torch.bfloat16
INT4_ROW_BLOCK = 16  # the int4 packing wants output rows in multiples of this
QUANTIZE_ROWS_PER_BLOCK = 4096
# Embedding rows of recent tokens kept (QuantizedEmbedding), and the most ids a call takes from them.
EMBEDDING_CACHE_BYTES = 16 << 20
EMBEDDING_CACHED_IDS = 64


@dataclass
class Int8Weight:
    """w[n, k] = codes[n, k] * scales[n]."""

    codes: torch.Tensor  # [N, K] int8 in -127..127
    scales: torch.Tensor  # [N] bf16

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        codes, scales = (self.codes, self.scales) if rows is None else (self.codes[rows], self.scales[rows])
        return codes.float() * scales.float()[:, None]  # [rows, K] fp32, exact


@dataclass
class Int4Weight:
    """w[n, k] = (code[n, k] - 8) * scales[n, k // group_size] + zeros[n, k // group_size]; codes
    are packed two per byte, code[n, 2i] in the low nibble of nibbles[n, i]."""

    nibbles: torch.Tensor  # [N, K / 2] uint8
    scales: torch.Tensor  # [N, K / group_size] bf16
    zeros: torch.Tensor  # [N, K / group_size] bf16
    group_size: int

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> "Int4Weight":
        # Each pair of codes read as one little-endian int16 (low byte first): whole-tensor ops, no
        # strided ones, which are ten times slower on a large matrix.
        pairs = codes.to(torch.uint8).contiguous().view(torch.int16)  # [N, K / 2]
        nibbles = ((pairs & 0x0F) | ((pairs >> 4) & 0xF0)).to(torch.uint8)
        return cls(nibbles, scales.to(KERNEL_DTYPE), zeros.to(KERNEL_DTYPE), group_size)

    def codes(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        nibbles = (self.nibbles if rows is None else self.nibbles[rows]).to(torch.int16)
        return ((nibbles & 15) | ((nibbles >> 4) << 8)).view(torch.uint8)  # [rows, K] uint8, code 2i first

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        scales, zeros = (self.scales, self.zeros) if rows is None else (self.scales[rows], self.zeros[rows])
        g = self.group_size
        codes = self.codes(rows).float().unflatten(1, (-1, g))  # [rows, K / g, g]
        return ((codes - 8) * scales.float()[..., None] + zeros.float()[..., None]).flatten(1)  # [rows, K] fp32


@dataclass
class GroupedInt8Weight:
    """w[n, k] = codes[n, k] * scales[n, k // group_size] + offsets[n, k // group_size]."""

    codes: torch.Tensor  # [N, K] uint8
    scales: torch.Tensor  # [N, K / group_size] fp32
    offsets: torch.Tensor  # [N, K / group_size] fp32
    group_size: int

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        codes, scales, offsets = ((self.codes, self.scales, self.offsets) if rows is None
                                  else (self.codes[rows], self.scales[rows], self.offsets[rows]))
        g = self.group_size
        w = codes.float().unflatten(1, (-1, g)) * scales[..., None] + offsets[..., None]  # [rows, K / g, g]
        return w.flatten(1)

    def centered_five(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(codes, scales) with w = (code - 16) * scale, where the codes are below 32 and every offset
        is -16 times its scale in groups of 32 and every scale an fp16 value (a GGUF file's Q5_0, its
        own codes); else None."""
        if self.group_size != INPUT_BLOCK or not self.codes.numel() or int(self.codes.max()) >= 32:
            return None
        if not torch.equal(self.offsets, -16 * self.scales) or not fp16_values(self.scales):
            return None
        return self.codes, self.scales

    def centered_eight(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(codes, scales) with w = (code - 128) * scale, the same values, where in groups of 32 every
        offset is -k times its scale for a whole k in 0..128 that leaves the codes plus 128 - k below
        256, every scale an fp16 value (a GGUF file's Q8_0: k = 128, the same codes; Q5_0 fused beside
        Q8_0: k = 16); else None."""
        if self.group_size != INPUT_BLOCK or not self.codes.numel() or not fp16_values(self.scales):
            return None
        k = torch.where(self.scales == 0, 128.0, -self.offsets / self.scales)  # a zero scale takes any k: 128
        whole = torch.equal(k, k.round()) and bool(((k >= 0) & (k <= 128)).all())
        if not (whole and torch.equal(-k * self.scales, self.offsets)):  # a zero scale's offset must be 0 too
            return None
        shift = (128 - k).to(torch.int16).repeat_interleave(INPUT_BLOCK, 1)
        codes = self.codes.to(torch.int16) + shift
        if int(codes.max()) > 255:
            return None
        return codes.to(torch.uint8), self.scales

    @classmethod
    def of(cls, weight: "QuantizedWeight", group_size: int) -> "GroupedInt8Weight":
        """An int4 or grouped int8 weight as grouped int8 in groups of `group_size` (a divisor of its
        own), the same values: so matrices of different formats fuse (a GGUF file's Q4_K q and k beside
        its Q6_K v)."""
        repeat = weight.group_size // group_size
        if isinstance(weight, Int4Weight):
            scales = weight.scales.float()
            # (code - 8) * s + z = code * s + (z - 8 s), the offset the int4 kernel computes too.
            return cls(weight.codes(), scales.repeat_interleave(repeat, 1),
                       (weight.zeros.float() - 8 * scales).repeat_interleave(repeat, 1), group_size)
        if isinstance(weight, SuperblockInt8Weight):
            weight = weight.grouped()
        if isinstance(weight, GroupedInt8Weight):
            return cls(weight.codes, weight.scales.repeat_interleave(repeat, 1),
                       weight.offsets.repeat_interleave(repeat, 1), group_size)
        raise ValueError(f"{_describe(weight)} cannot become grouped int8")


@dataclass
class SuperblockInt8Weight:
    """Grouped codes whose scale and offset factor into an fp32 pair per superblock of 256 inputs
    times an int8 pair per group: scale = factors[n, s, 0] * multipliers[n, g, 0] and offset =
    factors[n, s, 1] * multipliers[n, g, 1] for group g of superblock s. The products are exact (a
    GGUF file's Q4_K, Q5_K and Q6_K scales: an fp16 times an integer of at most 8 bits), so this is
    GroupedInt8Weight's values in 1.25 bits a weight of scales where that takes 4 (groups of 16)."""

    codes: torch.Tensor  # [N, K] uint8 below 2 ** bits (Q4_K's 4 bits, Q5_K's 5, Q6_K's 6)
    factors: torch.Tensor  # [N, K / 256, 2] fp32
    multipliers: torch.Tensor  # [N, K / group_size, 2] int8
    group_size: int
    bits: int = 6  # 4, 5 (in groups of 32) or 6: the width the codes are stored in

    def scales_offsets(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 scales and offsets [rows, K / group_size] of `rows` (all when None)."""
        factors, multipliers = (self.factors, self.multipliers) if rows is None else (self.factors[rows], self.multipliers[rows])
        factors = factors.repeat_interleave(SUPERBLOCK // self.group_size, dim=1)  # [rows, G, 2]
        products = factors * multipliers.float()
        return products[..., 0], products[..., 1]

    def grouped(self) -> GroupedInt8Weight:
        return GroupedInt8Weight(self.codes, *self.scales_offsets(), self.group_size)

    def regrouped(self, group_size: int) -> "SuperblockInt8Weight":
        """The same weight in groups of `group_size` (a divisor of its own), codes of 6 bits."""
        repeat = self.group_size // group_size
        return SuperblockInt8Weight(self.codes, self.factors, self.multipliers.repeat_interleave(repeat, dim=1),
                                    group_size, 6)

    def as_int4(self) -> Int4Weight:
        """4-bit codes for aten's int4 kernel: bf16 scales and zeros (rounded, as aten takes them)."""
        scales, offsets = self.scales_offsets()
        # code * s + m = (code - 8) * s + (m + 8 s): int4's zero point is m + 8 s.
        return Int4Weight.from_codes(self.codes, scales, offsets + 8 * scales, self.group_size)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        codes = self.codes if rows is None else self.codes[rows]
        return GroupedInt8Weight(codes, *self.scales_offsets(rows), self.group_size).dequantize()


QuantizedWeight = Int8Weight | Int4Weight | GroupedInt8Weight | SuperblockInt8Weight


def cat_rows(parts: list):
    """Stack matrices along output rows (fusing q/k/v or gate/up): tensors or quantized weights
    of one kind; superblock-scaled ones of different groups or widths (Q4_K q and k beside Q6_K v)
    become 6-bit codes in the smallest group; int4 and grouped int8 mixed otherwise become grouped
    int8 in the smallest group."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if all(isinstance(p, SuperblockInt8Weight) for p in parts) and len({(p.group_size, p.bits) for p in parts}) > 1:
        group_size = min(p.group_size for p in parts)
        parts = [p.regrouped(group_size) for p in parts]
        first = parts[0]
    elif any(type(p) is not type(first) or getattr(p, "group_size", None) != getattr(first, "group_size", None)
             for p in parts):
        if not all(isinstance(p, (Int4Weight, GroupedInt8Weight, SuperblockInt8Weight)) for p in parts):
            raise ValueError(f"cannot fuse matrices of different formats: {[_describe(p) for p in parts]}")
        group_size = min(p.group_size for p in parts)
        parts = [GroupedInt8Weight.of(p, group_size) for p in parts]
        first = parts[0]
    return map_rows(first, lambda _, name: torch.cat([getattr(p, name) for p in parts]))


def map_rows(weight, fn):
    """A quantized weight with `fn(tensor, field_name)` applied to each per-row tensor."""
    return replace(weight, **{f.name: fn(getattr(weight, f.name), f.name) for f in fields(weight)
                              if isinstance(getattr(weight, f.name), torch.Tensor)})


def _describe(weight) -> str:
    if isinstance(weight, Int4Weight):
        return f"int4 (groups of {weight.group_size})"
    if isinstance(weight, (GroupedInt8Weight, SuperblockInt8Weight)):
        return f"int8 (groups of {weight.group_size})"
    return type(weight).__name__


def round_up_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """The smallest bf16 >= x, for x >= 0: a scale rounded up keeps every code in range."""
    bits = (x.float().contiguous().view(torch.int32) + 0xFFFF) & -0x10000
    return bits.view(torch.float32).to(KERNEL_DTYPE)


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per output channel; |w - dequantized| <= scale / 2 for every weight. Rows go a
    block at a time, which bounds the fp32 temporaries of a large matrix (the embedding)."""
    parts = []
    for w in weight.detach().split(QUANTIZE_ROWS_PER_BLOCK):
        w = w.float()
        scales = round_up_to_bf16(w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(KERNEL_DTYPE).tiny)
        parts.append(Int8Weight(torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8), scales))
    return parts[0] if len(parts) == 1 else cat_rows(parts)


def quantize_grouped_int8(weight: torch.Tensor, group_size: int) -> GroupedInt8Weight:
    """Min-max per group of `group_size` inputs to codes 0..255 (fp32 scale and offset)."""
    groups = weight.detach().float().unflatten(1, (-1, group_size))  # [N, K / g, g]
    low, high = groups.amin(-1), groups.amax(-1)
    scales = ((high - low) / 255).clamp_min(torch.finfo(torch.float32).tiny)
    codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp_(0, 255)
    return GroupedInt8Weight(codes.flatten(1).to(torch.uint8), scales, low, group_size)


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Weight:
    """Min-max per group of `group_size` inputs; |w - dequantized| <= scale / 2 for every weight."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"int4 needs in_features divisible by the group size: {in_features} is not a "
                         f"multiple of {group_size} (choose a group size from {INT4_GROUP_SIZES} that divides it)")
    groups = weight.detach().float().unflatten(1, (-1, group_size))  # [N, K / g, g]
    low, high = groups.amin(-1), groups.amax(-1)
    zeros = (low + 8 * (high - low) / 15).to(KERNEL_DTYPE).float()
    # The zero point was rounded to bf16: widen the step so the 16 levels around it still cover [low, high].
    scales = round_up_to_bf16(torch.maximum((zeros - low) / 8, (high - zeros) / 7))
    scales = scales.clamp_min(torch.finfo(KERNEL_DTYPE).tiny).float()
    codes = torch.round((groups - zeros[..., None]) / scales[..., None] + 8).clamp_(0, 15)
    return Int4Weight.from_codes(codes.flatten(1), scales, zeros, group_size)


# A decode step calls these 120 times: every op skipped when it would do nothing counts.
def _kernel_input(x: torch.Tensor, in_features: int) -> torch.Tensor:
    return (x if x.dim() == 2 else x.reshape(-1, in_features)).to(KERNEL_DTYPE)  # [rows, K]


def _finish(out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = out.to(x.dtype)
    if x.dim() != 2:
        out = out.reshape(*x.shape[:-1], -1)
    return out + bias if bias is not None else out


class Int8Linear(nn.Module):
    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.codes.shape
        self.quantized = weight  # the kernel reads it as it is; so do row lookups
        self.bias = bias
        self.weight_bytes = weight.codes.numel() + weight.scales.numel() * weight.scales.element_size()

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.quantized.dequantize(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.quantized
        return _finish(torch.ops.aten._weight_int8pack_mm(_kernel_input(x, self.in_features), w.codes, w.scales),
                       x, self.bias)


class Int4Linear(nn.Module):
    """The kernel's packed layout depends on the CPU's vector width, so rows are read from the
    plain nibbles instead, kept only where rows are needed (`keep_rows`: the output head, whose
    rows are the tied embedding and the logits of a vocabulary slice)."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None, keep_rows: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.nibbles.shape[0], weight.nibbles.shape[1] * 2
        self.group_size = weight.group_size
        self.bias = bias
        # The packing takes rows in blocks of 16: pad with zero rows, cut from the output.
        padding = self.padded_rows = -self.out_features % INT4_ROW_BLOCK
        codes = F.pad(weight.codes().to(torch.int32), (0, 0, 0, padding), value=8)
        scales, zeros = (F.pad(t, (0, 0, 0, padding)) for t in (weight.scales, weight.zeros))
        # innerKTiles (the 1) is ignored by the CPU packing.
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        self.scales_and_zeros = torch.stack((scales.T, zeros.T), dim=-1).contiguous()  # [K / g, N, 2]
        self.quantized = weight if keep_rows else None
        self.weight_bytes = self.packed.numel() + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size()

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        if self.quantized is None:
            raise ValueError("this int4 linear was made without keep_rows: its rows cannot be read")
        return self.quantized.dequantize(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(_kernel_input(x, self.in_features), self.packed,
                                                         self.group_size, self.scales_and_zeros)
        return _finish(out if self.padded_rows == 0 else out[:, : self.out_features], x, self.bias)


class QuantizedEmbedding(nn.Module):
    """Embedding rows dequantized from a quantized matrix: a quantized weight, or a linear (anything
    with `dequantize(rows)`). A linear it `owned` is its submodule `matrix` (an untied embedding's own);
    one it does not own (the tied output head) is not registered, so its tensors are the head's alone.

    A decoding pass embeds a few tokens, and dequantizing them takes a dozen torch calls on caches
    the pass has just emptied (about 5% of a dense step at 135M), so the rows of recent tokens are
    kept, up to EMBEDDING_CACHE_BYTES (emptied when full); a prompt's many rows are dequantized at once."""

    def __init__(self, source, dtype: torch.dtype, owned: bool = False) -> None:
        super().__init__()
        if owned:
            self.matrix = source
        self.dequantize = source.dequantize
        self.dtype = dtype
        self.recent: dict[int, torch.Tensor] = {}  # token id -> its row [hidden]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() > EMBEDDING_CACHED_IDS:
            return self.dequantize(ids.flatten()).to(self.dtype).view(*ids.shape, -1)  # [T, hidden]
        tokens = ids.flatten().tolist()
        found = {token: self.recent.get(token) for token in tokens}
        missing = [token for token, row in found.items() if row is None]
        if missing:
            rows = self.dequantize(torch.tensor(missing)).to(self.dtype)
            if (len(self.recent) + len(missing)) * rows[0].nbytes > EMBEDDING_CACHE_BYTES:
                self.recent.clear()
            for token, row in zip(missing, rows):
                found[token] = self.recent[token] = row
        return torch.stack([found[token] for token in tokens]).view(*ids.shape, -1)


def quantized_linear(weight: QuantizedWeight, bias: torch.Tensor | None = None, keep_rows: bool = False,
                     kernels=None) -> nn.Module:
    """The linear for `weight`: on the CPU kernels (int8 activations, rows independent) when given,
    else on aten's weight-only kernels (bf16 activations)."""
    in_features = weight.nibbles.shape[1] * 2 if isinstance(weight, Int4Weight) else weight.codes.shape[1]
    if isinstance(weight, SuperblockInt8Weight) and (kernels is None or in_features % SUPERBLOCK) and weight.bits == 4:
        weight = weight.as_int4()
    if isinstance(weight, (GroupedInt8Weight, SuperblockInt8Weight)) and kernels is None:
        # No aten kernel takes grouped int8: the matrix runs dense (exact, four times the bytes).
        return _dense_linear(weight.dequantize(), bias)
    if isinstance(weight, SuperblockInt8Weight) and in_features % SUPERBLOCK == 0:
        return IntegerLinear.from_superblocks(weight.codes, weight.factors, weight.multipliers, weight.group_size,
                                              kernels, bias, weight.bits)
    if isinstance(weight, SuperblockInt8Weight):
        weight = weight.grouped()
    if kernels is not None and in_features % INPUT_BLOCK == 0:
        if isinstance(weight, GroupedInt8Weight) and (centered := weight.centered_five()) is not None:
            return IntegerLinear.from_centered(*centered, kernels, bias)
        if isinstance(weight, GroupedInt8Weight) and (centered := weight.centered_eight()) is not None:
            return IntegerLinear.from_centered(*centered, kernels, bias, bits=8)
        if isinstance(weight, GroupedInt8Weight):
            codes, scales_zeros = weight.codes, torch.stack((weight.scales, weight.offsets), dim=-1)
        elif isinstance(weight, Int8Weight):
            scales = weight.scales.float()  # w = (code + 128) * s - 128 s
            codes, scales_zeros = (weight.codes.to(torch.int16) + 128).to(torch.uint8), torch.stack((scales, -128 * scales), dim=-1)
        else:
            codes, scales_zeros = weight.codes(), torch.stack((weight.scales, weight.zeros), dim=-1)
        bits = 4 if isinstance(weight, Int4Weight) else 8
        return IntegerLinear.from_codes(codes, scales_zeros, bits, getattr(weight, "group_size", 0), kernels, bias)
    if isinstance(weight, Int8Weight):
        return Int8Linear(weight, bias)
    return Int4Linear(weight, bias, keep_rows)


def _dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.float(), requires_grad=False)
    return linear


def int8_linears(module: nn.Module, kernels) -> nn.Module:
    """Every nn.Linear of `module` (a drafter's small head) as int8, one scale per output row, on
    the CPU kernels, in place; `module` itself may be the linear."""
    for name, linear in [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear)]:
        bias = None if linear.bias is None else linear.bias.detach()
        quantized = quantized_linear(quantize_int8(linear.weight), bias, kernels=kernels)
        if not name:
            return quantized
        module.set_submodule(name, quantized)
    return module


def check_quantization(name: str, device: torch.device | str = "cpu", group_size: int = DEFAULT_INT4_GROUP_SIZE) -> None:
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {name!r} (choose from {', '.join(QUANTIZATIONS)})")
    if name not in ("none", "auto") and torch.device(device).type != "cpu":
        raise ValueError(f"quantization {name} runs on the CPU only for now: use --device cpu, or --quantization none")
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size {group_size} is not one of {INT4_GROUP_SIZES}")


def automatic_quantization(config, device: torch.device | str) -> str:
    """What "auto" (the default) picks: on the CPU the fastest format whose speculation is lossless,
    int4 (int8 when the model's matrices do not split into groups of 32); elsewhere none."""
    if torch.device(device).type != "cpu":
        return "none"
    inputs = (config.hidden_size, config.num_attention_heads * config.head_dim, config.intermediate_size)
    return "int4" if all(k % DEFAULT_INT4_GROUP_SIZE == 0 for k in inputs) else "int8"


def quantize_model(model: nn.Module, name: str, group_size: int = DEFAULT_INT4_GROUP_SIZE, kernels=None) -> nn.Module:
    """Replace every nn.Linear of a built (unpacked) CPU model, and its embedding, by `name`'s
    quantized form, in place: "int8" or "int4" ("none" leaves the model as it is). With `kernels`
    (the CPU kernels) the linears take int8 activations; without, aten's bf16 ones."""
    check_quantization(name, model.device, group_size)
    if name == "gguf":
        raise ValueError("gguf keeps a GGUF file's own quantized tensors: it is chosen when loading the file")
    if name == "none":
        return model
    if any(isinstance(module, PackedLinear) for module in model.modules()):
        raise ValueError("quantize a model before CPU packing: packed linears keep no plain weight")
    model.source_fingerprint = weights_fingerprint(model)
    linears = [module_name for module_name, module in model.named_modules() if isinstance(module, nn.Linear)]
    # One matrix at a time, each installed as soon as it is quantized: its dense weight is freed
    # before the next is read, so the peak memory stays one dense copy of the model.
    for module_name in linears:
        linear = model.get_submodule(module_name)
        # The output head and the embedding stay int8 in the int4 format: int4 there moved the
        # default model's logits several times more than int4 in every layer did (BENCHMARKS.md).
        weight = (quantize_int8(linear.weight) if name == "int8" or module_name == "lm_head"
                  else quantize_int4(linear.weight, group_size))
        biases = {module_name: linear.bias.detach()} if linear.bias is not None else None
        install_quantized(model, {module_name: weight}, biases, kernels=kernels)
    if not model.config.tie_word_embeddings:
        install_quantized(model, {"embed_tokens": quantize_int8(model.embed_tokens.weight)}, kernels=kernels)
    return model


def install_quantized(model: nn.Module, weights: dict[str, QuantizedWeight],
                      biases: dict[str, torch.Tensor] | None = None, dtype: torch.dtype | None = None,
                      kernels=None) -> nn.Module:
    """Put quantized linears in place of the modules named in `weights` ("layers.0.mlp.down_proj",
    "lm_head", "embed_tokens"), with `biases` by the same names; outputs come in `dtype` (default:
    the model's). With tied embeddings the one matrix is the output head, and the embedding reads
    its rows. `kernels`: see `quantized_linear`. Empties `weights`: each plain weight is freed once
    its linear is made (unless aten's int4 linear keeps it for row lookups)."""
    dtype = dtype or model.norm.weight.dtype
    tied = model.config.tie_word_embeddings
    head_given = "lm_head" in weights
    while weights:
        module_name, weight = weights.popitem()
        if module_name == "embed_tokens":
            if tied:
                model.lm_head = quantized_linear(weight, keep_rows=True, kernels=kernels)
            if tied and hasattr(model.lm_head, "dequantize"):
                model.embed_tokens = QuantizedEmbedding(model.lm_head, dtype)  # the head's own rows
            elif not tied and kernels is not None and isinstance(matrix := quantized_linear(weight, kernels=kernels),
                                                               IntegerLinear):
                model.embed_tokens = QuantizedEmbedding(matrix, dtype, owned=True)  # packed: cached as it is
            else:  # off the kernels (or a dense tied head): rows from the weight
                model.embed_tokens = QuantizedEmbedding(weight, dtype)
        else:
            bias = (biases or {}).get(module_name)
            linear = quantized_linear(weight, None if bias is None else bias.to(dtype), keep_rows=module_name == "lm_head",
                                      kernels=kernels)
            model.set_submodule(module_name, linear)
    if tied and head_given:
        model.embed_tokens = QuantizedEmbedding(model.lm_head, dtype)
    return mark_quantized(model, kernels)


def mark_quantized(model: nn.Module, kernels) -> nn.Module:
    """What a model whose matrices are quantized runs differently."""
    for layer in model.layers:  # aten's kernels round rows alone; so must attention without the CPU kernels
        layer.self_attn.rows_alone = True
    model.extra_row_cost = extra_row_cost(kernels.tier if kernels is not None else None, model.multiply_adds_per_byte)
    return model


def extra_row_cost(tier: str | None, multiply_adds_per_byte: float) -> float:
    """One more row of a pass as a fraction of a one-row pass, on `tier`'s kernels (None: PyTorch's),
    for weights that make `multiply_adds_per_byte` multiply-adds a row per byte a pass reads."""
    measured = KERNEL_ROW_COST[tier] if tier is not None else ATEN_ROW_COST
    return measured * (multiply_adds_per_byte / REFERENCE_MULTIPLY_ADDS_PER_BYTE)
