"""Building blocks of the decoder that hold weights but run no kernel of their own: RMSNorm's
weight (the backend normalizes) and the rotary embedding's cos/sin tables."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """An RMSNorm's weight and epsilon; `backend.rms_norm` / `add_rms_norm` compute it."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps


class RotaryEmbedding(nn.Module):
    """HF-layout (rotate-half) RoPE with cos/sin precomputed for every position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, dtype: torch.dtype):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)  # [P, D]
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

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
