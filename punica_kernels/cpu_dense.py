"""CPU strategy for a whole step's LoRA terms: dense GEMMs over the occupied slots.

On a CPU, the grouped path (punica_kernels.cpu) pays fixed costs per op and per adapter that
dominate a decode step of many distinct adapters (measured: 32 tokens x 32 adapters at hidden
576 spent ~0.5 ms per op, x 240 ops per SmolLM2 step). Here each (layer, module) costs two
GEMMs for the whole batch, whatever the number of adapters:

    full = x @ A_all.T                 A_all = A[:S_used].reshape(S_used * R, K)
    v    = full * mask                 mask[t, s*R:(s+1)*R] = scale[s] for s = slot[t], else 0
    y   += v @ Bt_all                  Bt_all = B[:S_used].transpose(1, 2).reshape(S_used * R, N)

`mask` is built once per step and shared by every layer. Zero-padded rank rows of A and
columns of B contribute nothing, and slot -1 rows are all zero. The work is T x S_used x R x
(K + N) multiply-adds: more FLOPs than the grouped path when few tokens share many slots, but
each adapter's weights are read once per step in two large GEMMs, which is what a 2-core CPU
does well. Semantics are those of bgmv_shrink + bgmv_expand (punica_kernels/__init__.py).
"""
from __future__ import annotations

import torch


def slot_mask(token_slots: list[int], scales: torch.Tensor, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """Build mask [T, S_used * rank] and S_used (highest used slot + 1) for one step."""
    used = max(token_slots) + 1
    T = len(token_slots)
    mask = torch.zeros(T, used, rank, dtype=dtype)
    slots = torch.tensor(token_slots)
    rows = (slots >= 0).nonzero().squeeze(1)
    if rows.numel():
        s = slots[rows]
        mask[rows, s] = scales[s].to(dtype)[:, None].expand(-1, rank)
    return mask.reshape(T, used * rank), used


def lora_dense(x: torch.Tensor, a_stack: torch.Tensor, bt_stack: torch.Tensor, mask: torch.Tensor,
               used: int, y: torch.Tensor) -> None:
    """y += ((x @ A_all.T) * mask) @ Bt_all over slots [0, used).

    x: [T, K]; a_stack: [S, R, K]; bt_stack: [S, R, N] (B transposed per slot); mask: [T, used*R];
    y: [T, N] view, updated in place.
    """
    S, R, K = a_stack.shape
    full = torch.nn.functional.linear(x, a_stack[:used].reshape(used * R, K))
    full.mul_(mask)
    y.addmm_(full, bt_stack[:used].reshape(used * R, -1))
