"""Rotary embedding frequencies, including the scaled variants checkpoints ask for."""

from __future__ import annotations

import math

import torch

from kiln.models.config import RopeConfig


def inv_freq(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies (float32, shape [rotary_dim // 2])."""
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    freq = 1.0 / (rope.theta**exps)
    if rope.rope_type == "linear":
        return freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3(freq, rope)
    return freq


def _llama3(freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    old_ctx = rope.original_max_position_embeddings or 8192
    low_wavelen = old_ctx / rope.low_freq_factor
    high_wavelen = old_ctx / rope.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / rope.factor, freq)
    smooth = (old_ctx / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)
