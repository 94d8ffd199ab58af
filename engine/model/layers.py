"""Building blocks of the decoder that hold weights but run no kernel of their own: RMSNorm's
weight (the backend normalizes) and the rotary embedding's cos/sin tables."""
from __future__ import annotations

import torch
from torch import nn

from engine.config import RopeConfig
from engine.model.rope import rope_tables


class RMSNorm(nn.Module):
    """An RMSNorm's weight and epsilon; `backend.rms_norm` / `add_rms_norm` compute it."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps


class RotaryEmbedding(nn.Module):
    """HF-layout (rotate-half) RoPE with cos/sin precomputed for every position, for any RoPE
    variant (engine.model.rope: scaling and attention factors are in the tables)."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig | float, dtype: torch.dtype):
        """`rope`: the RoPE to tabulate, or a theta for the default one."""
        super().__init__()
        if not isinstance(rope, RopeConfig):
            rope = RopeConfig(theta=float(rope))
        cos, sin = rope_tables(rope, head_dim, max_positions)
        self.register_buffer("cos", cos.to(dtype), persistent=False)  # [P, D]
        self.register_buffer("sin", sin.to(dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> (cos, sin) [T, 1, D], computed once per step for every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D] (q and k heads side by side, rotated in one pass) -> rotated x."""
        cos, sin = cos_sin
        return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
