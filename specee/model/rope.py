"""Rotary position embeddings (rotate-half convention), with the Llama 3 and linear scalings, and a
second set of frequencies for the sliding layers where a model has one (Gemma 3)."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .config import LlamaConfig


ANGLE_TABLE_START = 512  # positions in a new AngleTable


class RopeAngles(NamedTuple):
    """cos and sign-folded sin for one pass, computed once and shared by every layer: one set of
    frequencies per `LlamaConfig.rope_bases` (R), a layer taking its own (`for_layer`)."""

    cos: torch.Tensor  # [T, R, head_dim]
    sin: torch.Tensor  # [T, R, head_dim]; first half negated so rotate-half becomes a roll

    def for_layer(self, index: int) -> "RopeAngles":
        """The angles of frequency set `index` ([T, 1, head_dim] each, broadcasting over heads)."""
        if self.cos.shape[1] == 1:
            return self
        return RopeAngles(self.cos[:, index : index + 1], self.sin[:, index : index + 1])


def inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    """[R, head_dim / 2]: the full layers' frequencies, then the sliding layers' where they differ.
    On the CPU whatever the default device (a model built on the meta device moves it later)."""
    with torch.device("cpu"):
        sets = [_inverse_frequencies(config, config.rope_theta, config.rope_scaling)]
        if config.rope_bases == 2:
            sets.append(_inverse_frequencies(config, config.rope_local_base_freq, None))
        return torch.stack(sets)


def _inverse_frequencies(config: LlamaConfig, base: float, scaling: dict | None) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    if kind == "frequency_factors":  # a GGUF file's rope_freqs: theta_i / factor_i, as llama.cpp's rope
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs has {factors.numel()} factors; head_dim {dim} needs {inv_freq.numel()}")
        return inv_freq / factors
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, frequency_factors)")


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor = scaling["factor"]
    low_factor, high_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_factor
    high_freq_wavelen = old_context / high_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_factor) / (high_factor - low_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_angles(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> RopeAngles:
    freqs = positions.float()[:, None, None] * inv_freq[None]  # [T, R, head_dim / 2]
    cos, sin = freqs.cos(), freqs.sin()
    cos = torch.cat((cos, cos), dim=-1)
    sin = torch.cat((-sin, sin), dim=-1)
    return RopeAngles(cos.to(dtype), sin.to(dtype))


class AngleTable:
    """The angles of positions 0..length-1, grown (doubling) as later positions come: a pass on the
    CPU reads its rows, two index calls instead of the eight that compute them (each on caches the
    pass before has emptied). A position's angles are the same computed alone or in a block
    (tests/test_rope.py), so the table changes no bits."""

    def __init__(self, inv_freq: torch.Tensor, dtype: torch.dtype) -> None:
        self.inv_freq, self.dtype = inv_freq, dtype
        # (length, cos, sin), replaced whole when it grows: a generation in another thread reads
        # either table, never a length with the other's rows.
        self.rows = (0, torch.empty(0), torch.empty(0))

    @property
    def length(self) -> int:
        return self.rows[0]

    def angles(self, positions: torch.Tensor) -> RopeAngles:
        length, cos, sin = self.rows
        end = int(positions.max()) + 1 if len(positions) else 0
        if end > length:
            length = max(ANGLE_TABLE_START, 2 * length, end)
            cos, sin = rope_angles(self.inv_freq, torch.arange(length), self.dtype)
            self.rows = (length, cos, sin)
        return RopeAngles(cos[positions], sin[positions])


def apply_rope(x: torch.Tensor, angles: RopeAngles) -> torch.Tensor:
    """x: [T, heads, head_dim]. rotate_half(x) * sin == (x's halves swapped) * sign-folded sin.
    The swap is a cat of two views: the values of `roll`, in fewer ops."""
    half = x.shape[-1] // 2
    return x * angles.cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * angles.sin


def angles_rows(angles: RopeAngles, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as the kernels take them: [T, R * head_dim] fp32 (each layer its set's columns)."""
    return angles.cos.reshape(T, -1).float().contiguous(), angles.sin.reshape(T, -1).float().contiguous()
