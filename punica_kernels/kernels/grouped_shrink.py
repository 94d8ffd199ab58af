"""Grouped shrink (decode): rows grouped by adapter, so one program multiplies a tile of its
slot's rows by that slot's A (tl.dot, tensor cores on GPU): an adapter's A is streamed once per
step however many rows share it, where BGMV streams it once per row.

Semantics (as bgmv_shrink; the grouping changes the order of work, not the result):
    # groups: rows of slot s are groups.order[groups.bounds[s]:groups.bounds[s+1]]
    for l, A in enumerate(slices):
        for t in range(T):
            s = token_slots[t]
            if s == -1:
                v[l, t, :] = 0
            else:
                r = ranks[s]
                v[l, t, :r] = scales[s] * (x[t] @ A[s, :r, :].T)   # fp32 accumulation
                v[l, t, r:] = 0
Every element of v is written (no pre-zeroed buffer). With SPLIT_K > 1 each program sums one
K range into a workspace; the last of a tile's programs to finish (a per-(slice, slot) counter)
adds the partials in split order and writes v: the result does not depend on which program ran
first, so repeated calls are bit-identical.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..metadata import DecodeGroups
from ._common import check_blocks, check_runnable, dot_in_fp32, next_pow2, slice_offsets, zeroed_counters


@triton.jit
def _grouped_shrink_kernel(
    x_ptr, a_offs, a0_ptr, order_ptr, bounds_ptr, scale_ptr, rank_ptr, v_ptr, part_ptr, count_ptr,
    S, R, K, stride_xt, stride_as, stride_ar, stride_vl, stride_vt, stride_pk, stride_pl,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    UNIT: tl.constexpr, IEEE: tl.constexpr,
):
    # grid = (S + 1, SPLIT_K, L): fixed by S and the shapes; slot S is the rows without adapter.
    s = tl.program_id(0)
    ks = tl.program_id(1)
    l = tl.program_id(2)
    start = tl.load(bounds_ptr + s)
    end = tl.load(bounds_ptr + s + 1)
    if start >= end:
        return  # no row on this slot this step
    offs_r = tl.arange(0, BLOCK_R)
    mask_rv = offs_r < R  # v's columns (the stack's padded rank)
    v_base = v_ptr + l.to(tl.int64) * stride_vl
    if s == S:
        if ks == 0:  # one program writes the zero rows of the no-adapter group
            for m0 in range(start, end, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                mask_m = offs_m < end
                rows = tl.load(order_ptr + offs_m, mask=mask_m, other=0)
                zero = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
                tl.store(v_base + rows[:, None] * stride_vt + offs_r[None, :], zero,
                         mask=mask_m[:, None] & mask_rv[None, :])
        return
    r = tl.load(rank_ptr + s)
    scale = tl.load(scale_ptr + s)
    mask_ra = offs_r < r  # A's rows this adapter has: padding past its rank is never read
    a_base = a0_ptr + tl.load(a_offs + l) * UNIT + s.to(tl.int64) * stride_as  # _common.slice_offsets
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = ks * k_span
    k_hi = tl.minimum(k_lo + k_span, K)
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < end
        rows = tl.load(order_ptr + offs_m, mask=mask_m, other=0)  # int64: row * stride must not wrap
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_hi
            xt = tl.load(x_ptr + rows[:, None] * stride_xt + offs_k[None, :],
                         mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            at = tl.load(a_base + offs_r[None, :].to(tl.int64) * stride_ar + offs_k[:, None],
                         mask=mask_ra[None, :] & mask_k[:, None], other=0.0)
            if IEEE:
                # full-precision fp32 products, not TF32 (see _common.dot_in_fp32)
                acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(xt, at)
        if SPLIT_K == 1:
            tl.store(v_base + rows[:, None] * stride_vt + offs_r[None, :], acc * scale,
                     mask=mask_m[:, None] & mask_rv[None, :])
        else:
            p_tile = part_ptr + ks * stride_pk + l * stride_pl + rows[:, None] * BLOCK_R + offs_r[None, :]
            tl.store(p_tile, acc, mask=mask_m[:, None])
    if SPLIT_K > 1:
        # Every thread's partial stores are issued before the count (barrier), and released with
        # it; the program that takes the last count acquires them all and reduces.
        tl.debug_barrier()
        counter = count_ptr + l * S + s
        done = tl.atomic_add(counter, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            for m0 in range(start, end, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                mask_m = offs_m < end
                rows = tl.load(order_ptr + offs_m, mask=mask_m, other=0)
                p_tile = part_ptr + l * stride_pl + rows[:, None] * BLOCK_R + offs_r[None, :]
                acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
                for j in range(SPLIT_K):  # split order: the same sum whichever program was last
                    acc += tl.load(p_tile + j * stride_pk, mask=mask_m[:, None], other=0.0,
                                   cache_modifier=".cg")
                tl.store(v_base + rows[:, None] * stride_vt + offs_r[None, :], acc * scale,
                         mask=mask_m[:, None] & mask_rv[None, :])
            tl.store(counter, 0)  # ready for the next launch (kernels on a stream run in order)


def default_split_k(K: int) -> int:
    """Programs per (slot, slice) along K: about one per 1024 columns, at most 8, so a step whose
    rows share few adapters still spreads each A over several SMs. Depends on K alone."""
    return max(1, min(8, triton.cdiv(K, 1024)))


def check_groups(groups, num_tokens: int, num_slots: int, device: torch.device) -> None:
    """A `DecodeGroups` for `num_tokens` rows over a stack of `num_slots` slots on `device`."""
    if not isinstance(groups, DecodeGroups):
        raise TypeError(f"groups must be a DecodeGroups (punica_kernels.group_decode_tokens), got {type(groups).__name__}")
    if groups.num_tokens != num_tokens or groups.num_slots != num_slots:
        raise ValueError(f"groups cover {groups.num_tokens} rows over {groups.num_slots} slots; "
                         f"this call has {num_tokens} rows and a stack of {num_slots} slots")
    if groups.order.device != device or groups.bounds.device != device:
        raise ValueError(f"groups are on {groups.order.device} but the other inputs are on {device}")


def grouped_shrink_triton(x, a_slices: list[torch.Tensor], groups: DecodeGroups, scales, ranks, v, *,
                          split_k: int | None = None, block_k: int | None = None):
    """Launch the grouped shrink into v. Semantics: see the module docstring.

    The caller checks the weights, scales and ranks (`_checks.check_add_lora`, or a `LoRAStack`);
    this checks the shapes it indexes with.

    Args:
        x: [T, K] fp16/bf16/fp32, contiguous, the dtype of the slices.
        a_slices: L stacks [S, R, K].
        groups: the rows grouped by slot (`group_decode_tokens` of their slots, S slots).
        scales: [S] float32; ranks: [S] int32/int64 (<= R).
        v: fp32 [L, T, R], contiguous: overwritten entirely (its prior contents are never read).
        split_k: programs per (slot, slice) along K (default: `default_split_k`); above 1 the
            partials go through an fp32 workspace and a deterministic last-program sum.
        block_k: K tile (power of two >= 16; default by R).
    Returns:
        v.
    """
    T, K = x.shape
    L = len(a_slices)
    S, R = a_slices[0].shape[:2]
    if tuple(v.shape) != (L, T, R) or v.dtype != torch.float32 or not v.is_contiguous():
        raise ValueError(f"v must be a contiguous fp32 [{L}, {T}, {R}] tensor; got {v.dtype} {tuple(v.shape)}")
    check_groups(groups, T, S, x.device)
    check_runnable(x.device)
    if T == 0 or R == 0 or L == 0:
        return v
    block_r = max(16, next_pow2(R))
    # Row tiles up to 64, fewer for wide ranks: the accumulator (BLOCK_M x BLOCK_R fp32) stays
    # in registers on sm_90 up to rank 256 (bench/sass.py).
    block_m = min(64, max(16, 4096 // block_r), max(16, next_pow2(T)))
    if block_k is None:
        block_k = 128 if block_r <= 32 else 64
    split_k = default_split_k(K) if split_k is None else split_k
    split_k = max(1, min(split_k, triton.cdiv(K, block_k)))
    check_blocks(minimum=16, block_k=block_k)
    if split_k > 1:
        part = torch.empty(split_k, L, T, block_r, dtype=torch.float32, device=x.device)
        counts = zeroed_counters(x.device, L * S)
    else:
        part, counts = v, v  # not read: the kernel's SPLIT_K == 1 branch never touches them
    offs, unit = slice_offsets(a_slices)
    a0 = a_slices[0]
    _grouped_shrink_kernel[(S + 1, split_k, L)](
        x, offs, a0, groups.order, groups.bounds, scales, ranks, v, part, counts,
        S, R, K, x.stride(0), a0.stride(0), a0.stride(1), v.stride(0), v.stride(1),
        part.stride(0) if split_k > 1 else 0, part.stride(1) if split_k > 1 else 0,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, SPLIT_K=split_k, UNIT=unit,
        IEEE=dot_in_fp32(x.dtype),
    )
    return v
