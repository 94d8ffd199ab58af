"""Row-wise int8 quantization of LoRA weights, the storage of int8 `LoRAStack`s.

    q, row_scales = quantize_rows(w)      # w [..., n] float -> q [..., n] int8, row_scales [...] fp32
    w ~= q * row_scales[..., None]
    int8_b_write(lora_b, slot, q)         # slot `slot`'s B (q int8 [N, rank]) into an int8 stack
    int8_b_read(lora_b, slot, rank)       # and back: [N, rank]

Symmetric, one scale per row (absmax / 127, so q lies in [-127, 127]): for A [R, K] a row is one
rank's K inputs, for B [N, R] one output's R ranks, and the kernels apply each row's scale once
to that row's dot product. An all-zero row (padding, an untargeted module) gets scale 0.

In an int8 stack's B slice [S, N, R] a slot of rank r holds its [N, r] values in the first N * r
bytes of its block, in rank pairs (`pack_int8_b`): a slot then reads N * r bytes whatever R (no
cache lines of padding), and the kernel's expand reads each pair of ranks as one forward stream,
multiplying a broadcast pair of the intermediate by 8 outputs at once (add_lora_cpu.c's b_at).
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


def pack_int8_b(q: torch.Tensor) -> torch.Tensor:
    """[N, r] -> the N * r values in int8 stacks' B order, flat: the ranks in pairs (2p, 2p + 1), each
    pair N rows of two (output n's two values side by side, n = 0 .. N - 1), and an odd r's last
    rank after them, N values."""
    n, r = q.shape
    pairs = q[:, : r - r % 2].reshape(n, r // 2, 2).transpose(0, 1).reshape(-1)
    return torch.cat([pairs, q[:, r - 1]]) if r % 2 else pairs


def unpack_int8_b(flat: torch.Tensor, n: int, rank: int) -> torch.Tensor:
    """`pack_int8_b`'s inverse: the first n * rank values of `flat` -> [n, rank]."""
    even = rank - rank % 2
    pairs = flat[: n * even].reshape(even // 2, n, 2).transpose(0, 1).reshape(n, even)
    return torch.cat([pairs, flat[n * even: n * rank].reshape(n, 1)], dim=1) if rank % 2 else pairs


def _slot_block(lora_b: torch.Tensor, slot: int, rank: int) -> torch.Tensor:
    if not 0 <= rank <= lora_b.shape[2]:
        raise ValueError(f"rank {rank} outside [0, {lora_b.shape[2]}] (the stack's R)")
    return lora_b[slot].view(-1)[: lora_b.shape[1] * rank]


def int8_b_write(lora_b: torch.Tensor, slot: int, q: torch.Tensor) -> None:
    """Write slot `slot`'s B, q [N, rank], into an int8 stack's B slice [S, N, R] (`pack_int8_b`'s
    order in the block's first N * rank entries), what a slot of that rank holds and the kernels
    read. Write it after setting the slot's rank."""
    if q.dim() != 2 or q.shape[0] != lora_b.shape[1]:
        raise ValueError(f"B must be [{lora_b.shape[1]}, rank], not {tuple(q.shape)}")
    _slot_block(lora_b, slot, q.shape[1]).copy_(pack_int8_b(q))


def int8_b_read(lora_b: torch.Tensor, slot: int, rank: int) -> torch.Tensor:
    """Slot `slot`'s B in an int8 stack's B slice [S, N, R] at its rank: [N, rank] (a copy)."""
    return unpack_int8_b(_slot_block(lora_b, slot, rank), lora_b.shape[1], rank)
