"""Rotary embedding frequencies, including the scaled variants checkpoints ask for."""

from __future__ import annotations

import math

import torch

from kiln.models.config import RopeConfig


def inv_freq(
    rope: RopeConfig, rotary_dim: int, head_dim: int | None = None, long: bool = False
) -> torch.Tensor:
    """Per-pair inverse frequencies (float32, shape [head_dim // 2]): the rotated pairs',
    then zeros for a partial rotary's pairs that pass through unturned (the head's features
    are in `rotary_order`). LongRoPE's long factors with `long`."""
    freq = _inv_freq(rope, rotary_dim, long)
    pad = (head_dim or rotary_dim) // 2 - freq.numel()
    return torch.cat((freq, torch.zeros(pad))) if pad else freq


def _inv_freq(rope: RopeConfig, rotary_dim: int, long: bool) -> torch.Tensor:
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    freq = 1.0 / (rope.theta**exps)
    if rope.rope_type == "longrope":
        ext = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        if ext.numel() != freq.numel():
            raise ValueError(f"longrope has {ext.numel()} factors for {freq.numel()} pairs")
        return 1.0 / (ext * rope.theta**exps)
    if rope.rope_type == "freq_factors":  # as llama.cpp divides by its rope_freqs tensor
        div = torch.tensor(rope.freq_factors, dtype=torch.float32)
        if div.numel() != freq.numel():
            raise ValueError(f"rope_freqs has {div.numel()} factors for {freq.numel()} pairs")
        return freq / div
    if rope.rope_type == "linear":
        return freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3(freq, rope)
    if rope.rope_type == "yarn":
        return _yarn(rope, rotary_dim)
    return freq


def _yarn(rope: RopeConfig, dim: int) -> torch.Tensor:
    # YaRN: high-frequency pairs kept (extrapolated), low ones divided by `factor`
    # (interpolated), a linear ramp between the pairs that turn beta_fast and beta_slow
    # times over the pretraining context. The tables are also scaled (attention_factor).
    ctx = rope.original_max_position_embeddings or 2048

    def pair(rotations: float) -> float:
        return dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = pair(rope.beta_fast), pair(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no ramp of width 0
    pos = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the pair's own frequency), 0: interpolate
    return (1.0 / (rope.factor * pos)) * (1 - keep) + (1.0 / pos) * keep


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
