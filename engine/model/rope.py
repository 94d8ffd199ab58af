"""Rotary embedding tables for every RoPE variant a checkpoint may state (engine.config.RopeConfig).

`rope_tables(rope, head_dim, max_positions)` -> (cos, sin) [P, D] in HF's rotate-half layout, the
attention factor (YaRN, LongRoPE) already multiplied in. Every variant is a table by position,
so the KV cache never needs re-rotating:
- dynamic NTK uses the theta it would have at the full scaled length (max_positions), for every
  position, as vLLM does: a key keeps one rotation for its whole life in the cache (transformers
  recomputes theta per sequence length, which rotates cached keys and new queries differently);
- LongRoPE takes the short factors below original_max_position and the long ones from there on,
  per position (transformers switches a whole sequence once it is longer than that).
Below those lengths both equal transformers' tables.
"""
from __future__ import annotations

import math

import torch

from engine.config import RopeConfig


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(rope: RopeConfig, inv: torch.Tensor) -> torch.Tensor:
    old = rope.original_max_position
    low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    factor, base, orig = rope.factor, rope.theta, rope.original_max_position
    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def longrope_attention_default(factor: float, original_max_position: int) -> float:
    """LongRoPE's cos/sin factor when the config states none (transformers' and llama.cpp's
    formula): sqrt(1 + ln(factor) / ln(original_max_position)), 1 for factor <= 1."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max_position))


def _longrope_attention(rope: RopeConfig) -> float:
    if rope.attention_factor is not None:
        return rope.attention_factor
    return longrope_attention_default(rope.factor, rope.original_max_position)


def inv_freq(rope: RopeConfig, head_dim: int, max_positions: int, *, long: bool = False) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] fp32, attention factor) of `rope`; `long` picks
    LongRoPE's long factors."""
    dim = head_dim
    if rope.rope_type == "yarn":
        inv, attention = _yarn(rope, dim)
    else:
        inv, attention = _default_inv_freq(rope.theta, dim), 1.0
        if rope.rope_type == "linear":
            inv = inv / rope.factor
        elif rope.rope_type == "dynamic":
            inv = _default_inv_freq(_dynamic_theta(rope, dim), dim)
        elif rope.rope_type == "llama3":
            inv = _llama3(rope, inv)
        elif rope.rope_type == "longrope":
            ext = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
            if ext.numel() != dim // 2:
                raise ValueError(f"longrope factors have {ext.numel()} entries, expected {dim // 2}")
            inv = 1.0 / (ext * rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            attention = _longrope_attention(rope)
    if rope.freq_factors is not None:
        ff = torch.tensor(rope.freq_factors, dtype=torch.float32)
        if ff.numel() != dim // 2:
            raise ValueError(f"rope_freqs has {ff.numel()} entries, expected {dim // 2}")
        inv = inv / ff
    return inv, attention


def rope_tables(rope: RopeConfig, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) fp32 [max_positions, head_dim] of `rope` (see the module docstring)."""
    t = torch.arange(max_positions, dtype=torch.float32)
    inv, attention = inv_freq(rope, head_dim, max_positions)
    freqs = torch.outer(t, inv)
    if rope.rope_type == "longrope":
        long_inv, _ = inv_freq(rope, head_dim, max_positions, long=True)
        beyond = t >= rope.original_max_position
        freqs[beyond] = torch.outer(t[beyond], long_inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention, emb.sin() * attention


def _dynamic_theta(rope: RopeConfig, dim: int) -> float:
    """Dynamic NTK's theta at sequence length max_position x factor (as transformers computes it
    for that length, with its max_position being the checkpoint's)."""
    f = rope.factor
    return rope.theta * ((f * f) - (f - 1)) ** (dim / (dim - 2))
