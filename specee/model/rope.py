"""Rotary position embeddings (rotate-half convention), with the Llama 3 and linear scalings."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .config import LlamaConfig


class RopeAngles(NamedTuple):
    """cos and sign-folded sin for one pass, computed once and shared by every layer."""

    cos: torch.Tensor  # [T, 1, head_dim]
    sin: torch.Tensor  # [T, 1, head_dim]; first half negated so rotate-half becomes a roll


def inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    """On the CPU whatever the default device (a model built on the meta device moves it later)."""
    with torch.device("cpu"):
        return _inverse_frequencies(config)


def _inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
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
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, head_dim / 2]
    cos, sin = freqs.cos(), freqs.sin()
    cos = torch.cat((cos, cos), dim=-1)
    sin = torch.cat((-sin, sin), dim=-1)
    return RopeAngles(cos[:, None, :].to(dtype), sin[:, None, :].to(dtype))


def apply_rope(x: torch.Tensor, angles: RopeAngles) -> torch.Tensor:
    """x: [T, heads, head_dim]. rotate_half(x) * sin == (x's halves swapped) * sign-folded sin.
    The swap is a cat of two views: the values of `roll`, in fewer ops."""
    half = x.shape[-1] // 2
    return x * angles.cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * angles.sin
