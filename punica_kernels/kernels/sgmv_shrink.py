"""SGMV shrink (prefill): tokens of one segment share one adapter, so a tile of a segment's
rows multiplies one A tile (a real matrix product, tensor cores on GPU).

Semantics:
    # seg_starts: [n+1], 0 = seg_starts[0] <= ... <= seg_starts[n] = T; seg_slots: [n]
    for l, A in enumerate(slices):
        for i in range(n):
            a, b, s = seg_starts[i], seg_starts[i+1], seg_slots[i]   # a == b: empty segment
            if s == -1:
                v[l, a:b, :] = 0
            else:
                r = ranks[s]
                v[l, a:b, :r] = scales[s] * (x[a:b] @ A[s, :r, :].T)   # fp32 accumulation
                v[l, a:b, r:] = 0
Only rows [0, ranks[s]) of A[s] are read: work is proportional to each segment's rank. Every
element of v is written, zeros included, so v needs no zero-filled buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._checks import check_segments, check_shrink
from ._common import check_blocks, check_runnable, dot_in_fp32, slice_tables


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr, a_ptrs, a0_ptr, starts_ptr, seg_slot_ptr, scale_ptr, rank_ptr, v_ptr,
    R, K, M_BLOCKS, stride_xt, stride_as, stride_ar, stride_vl, stride_vt,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    # grid = (n_segments * M_BLOCKS, cdiv(R, BLOCK_R), L), M_BLOCKS = cdiv(max segment length, BLOCK_M)
    seg = tl.program_id(0) // M_BLOCKS
    mb = tl.program_id(0) % M_BLOCKS
    rb = tl.program_id(1)
    l = tl.program_id(2)
    start = tl.load(starts_ptr + seg).to(tl.int64)
    end = tl.load(starts_ptr + seg + 1).to(tl.int64)
    m0 = start + mb * BLOCK_M
    if m0 >= end:
        return  # shorter (or empty) segment
    offs_m = m0 + tl.arange(0, BLOCK_M)  # int64: row * stride must not wrap
    mask_m = offs_m < end
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    # Every tile of v is written here, zeros included (no slot, past the rank): v needs no fill.
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    s = tl.load(seg_slot_ptr + seg).to(tl.int64)
    if s >= 0:
        r = tl.load(rank_ptr + s)
        if rb * BLOCK_R < r:  # rank blocks past this adapter's rank read nothing
            a_base = tl.load(a_ptrs + l).to(tl.pointer_type(a0_ptr.dtype.element_ty)) + s * stride_as
            mask_r = offs_r < r
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < K
                xt = tl.load(x_ptr + offs_m[:, None] * stride_xt + offs_k[None, :],
                             mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                at = tl.load(a_base + offs_r[None, :].to(tl.int64) * stride_ar + offs_k[:, None],
                             mask=mask_r[None, :] & mask_k[:, None], other=0.0)
                if IEEE:
                    # full-precision fp32 products, not TF32 (see _common.dot_in_fp32)
                    acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(xt, at)
            acc = acc * tl.load(scale_ptr + s)
    v_tile = v_ptr + l.to(tl.int64) * stride_vl + offs_m[:, None] * stride_vt + offs_r[None, :]
    tl.store(v_tile, acc, mask=mask_m[:, None] & (offs_r < R)[None, :])


def sgmv_shrink_triton(x, lora_a, seg_starts, seg_slots, scales, ranks, *, max_segment_len=None,
                       out=None, block_m: int = 32, block_r: int = 16, block_k: int = 64):
    """Launch SGMV shrink. Semantics: see the module docstring.

    Args:
        x: [T, K] fp16/bf16/fp32, contiguous.
        lora_a: [S, R, K] stack (same dtype as x), or a sequence of such stacks (one per slice).
        seg_starts: [n+1] int32/int64, segment boundaries (0 ... T, non-decreasing).
        seg_slots: [n] int32/int64, slot of each segment, -1 = no adapter.
        scales: [S] float32; ranks: [S] int32/int64 (<= R).
        max_segment_len: longest segment (from the metadata, known on the host); None means T,
            an upper bound that keeps the launch shape fixed without a device sync.
        out: optional fp32 buffer of the returned shape; it is overwritten.
    Returns:
        v: fp32 [T, R] for one stack, [L, T, R] for a sequence of L stacks.
    Raises:
        TypeError / ValueError on a bad dtype, shape, device, contiguity, segment, slot or rank;
        RuntimeError where this process's kernels cannot run on x's device (_common.check_runnable).
    """
    args = check_shrink(x, lora_a, scales, ranks, out)
    check_segments(seg_starts, seg_slots, args.num_tokens, args.num_slots, x.device)
    v = sgmv_shrink_into(x, args.slices, seg_starts, seg_slots, scales, ranks, args.out,
                         max_segment_len=max_segment_len, block_m=block_m, block_r=block_r, block_k=block_k)
    return v[0] if args.single else v


def sgmv_shrink_into(x, a_slices: list[torch.Tensor], seg_starts, seg_slots, scales, ranks, v, *,
                     max_segment_len=None, block_m: int = 32, block_r: int = 16, block_k: int = 64):
    """Launch SGMV shrink into v (fp32 [L, T, R], contiguous), every element of which it writes:
    v may come from torch.empty. The caller has checked the arguments (sgmv_shrink_triton, or
    add_lora's checks). Returns v."""
    check_blocks(minimum=16, block_m=block_m, block_r=block_r, block_k=block_k)
    check_runnable(x.device)
    T, K = x.shape
    L, R = len(a_slices), a_slices[0].shape[1]
    n_seg = seg_slots.shape[0]
    max_len = T if max_segment_len is None else int(max_segment_len)
    if T == 0 or R == 0 or n_seg == 0 or max_len <= 0:
        return v
    if K == 0:
        return v.zero_()
    ptrs, _ = slice_tables(a_slices, [0] * L, [0] * L)
    a0 = a_slices[0]
    m_blocks = triton.cdiv(max_len, block_m)
    grid = (n_seg * m_blocks, triton.cdiv(R, block_r), L)
    _sgmv_shrink_kernel[grid](
        x, ptrs, a0, seg_starts, seg_slots, scales, ranks, v,
        R, K, m_blocks, x.stride(0), a0.stride(0), a0.stride(1), v.stride(0), v.stride(1),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, IEEE=dot_in_fp32(x.dtype),
    )
    return v
