"""Readable, slow reference for the four ops, for tests. Computes in float64 and returns new
tensors (it never updates y in place), so a test compares a kernel against exact math.

Shapes and meaning are those of the package docstring; per token (BGMV) or per segment (SGMV):
    v[l, t, :r] = scales[s] * x[t] @ A_l[s, :r].T            (v[l, t] = 0 when s == -1)
    y[t, off_l : off_l + N_l] += v[l, t, :r] @ B_l[s, :, :r].T
"""

from __future__ import annotations

import torch


def _slices(w):
    return ([w], True) if isinstance(w, torch.Tensor) else (list(w), False)


def _expand_setup(v, lora_b, y, offsets):
    """(slices of B, v as [L, T, R], each slice's first column in y, a float64 copy of y)."""
    slices, single = _slices(lora_b)
    v3 = v.unsqueeze(0) if single else v
    if offsets is None:
        offsets = [sum(b.shape[1] for b in slices[:i]) for i in range(len(slices))]
    elif isinstance(offsets, int):
        offsets = [offsets]
    return slices, v3, offsets, y.double().clone()


def bgmv_shrink(x, lora_a, token_slots, scales, ranks) -> torch.Tensor:
    """float64 v: [T, R] for one stack, [L, T, R] for a sequence of stacks."""
    slices, single = _slices(lora_a)
    T, R = x.shape[0], slices[0].shape[1]
    v = torch.zeros(len(slices), T, R, dtype=torch.float64)
    for l, A in enumerate(slices):
        for t in range(T):
            s = int(token_slots[t])
            if s < 0:
                continue
            r = int(ranks[s])
            v[l, t, :r] = float(scales[s]) * (x[t].double() @ A[s, :r].double().T)
    return v[0] if single else v


def bgmv_expand(v, lora_b, token_slots, ranks, y, offsets=None) -> torch.Tensor:
    """float64 copy of y with every token's LoRA output added to its columns."""
    slices, v3, offsets, out = _expand_setup(v, lora_b, y, offsets)
    for l, B in enumerate(slices):
        off, n = offsets[l], B.shape[1]
        for t in range(out.shape[0]):
            s = int(token_slots[t])
            if s < 0:
                continue
            r = int(ranks[s])
            out[t, off:off + n] += v3[l, t, :r].double() @ B[s, :, :r].double().T
    return out


def sgmv_shrink(x, lora_a, seg_starts, seg_slots, scales, ranks) -> torch.Tensor:
    """float64 v, as bgmv_shrink, with one slot per segment [seg_starts[i], seg_starts[i+1])."""
    slices, single = _slices(lora_a)
    T, R = x.shape[0], slices[0].shape[1]
    v = torch.zeros(len(slices), T, R, dtype=torch.float64)
    for l, A in enumerate(slices):
        for i in range(len(seg_slots)):
            a, b, s = int(seg_starts[i]), int(seg_starts[i + 1]), int(seg_slots[i])
            if s < 0 or a == b:
                continue
            r = int(ranks[s])
            v[l, a:b, :r] = float(scales[s]) * (x[a:b].double() @ A[s, :r].double().T)
    return v[0] if single else v


def sgmv_expand(v, lora_b, seg_starts, seg_slots, ranks, y, offsets=None) -> torch.Tensor:
    """float64 copy of y with every segment's LoRA output added to its columns."""
    slices, v3, offsets, out = _expand_setup(v, lora_b, y, offsets)
    for l, B in enumerate(slices):
        off, n = offsets[l], B.shape[1]
        for i in range(len(seg_slots)):
            a, b, s = int(seg_starts[i]), int(seg_starts[i + 1]), int(seg_slots[i])
            if s < 0 or a == b:
                continue
            r = int(ranks[s])
            out[a:b, off:off + n] += v3[l, a:b, :r].double() @ B[s, :, :r].double().T
    return out
