"""Row-wise int8 quantization of LoRA weights, the storage of int8 `LoRAStack`s.

    q, row_scales = quantize_rows(w)      # w [..., n] float -> q [..., n] int8, row_scales [...] fp32
    w ~= q * row_scales[..., None]
    int8_b_view(lora_b, slot, rank)       # where slot `slot`'s [N, rank] B lives in an int8 stack

Symmetric, one scale per row (absmax / 127, so q lies in [-127, 127]): for A [R, K] a row is one
rank's K inputs, for B [N, R] one output's R ranks, and the kernels apply each row's scale once
to that row's dot product. An all-zero row (padding, an untargeted module) gets scale 0.
"""
from __future__ import annotations

import torch

QMAX = 127


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8, fp32 row scales) of a float tensor with rows along its last dim; raises
    TypeError for a non-float tensor and ValueError for NaN or Inf values."""
    if not isinstance(w, torch.Tensor) or not w.dtype.is_floating_point:
        raise TypeError(f"quantize_rows takes a float tensor, got {getattr(w, 'dtype', type(w).__name__)}")
    if w.dim() == 0:
        raise ValueError("quantize_rows needs at least one dim (its rows)")
    w = w.float()
    scale = w.abs().amax(dim=-1) / QMAX if w.shape[-1] else w.new_zeros(w.shape[:-1])
    if not torch.isfinite(scale).all():  # amax propagates NaN and Inf: one check per row, not per weight
        raise ValueError("cannot quantize NaN or Inf weights")
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def int8_b_view(lora_b: torch.Tensor, slot: int, rank: int) -> torch.Tensor:
    """Slot `slot`'s B in an int8 stack's B slice [S, N, R]: an [N, rank] view of the slot's
    first N * rank entries (rows packed at the slot's own rank, not at R), what a slot of that
    rank holds and the kernels read. Write it after setting the slot's rank, read it with it."""
    if not 0 <= rank <= lora_b.shape[2]:
        raise ValueError(f"rank {rank} outside [0, {lora_b.shape[2]}] (the stack's R)")
    n = lora_b.shape[1]
    return lora_b[slot].view(-1)[: n * rank].view(n, rank)
