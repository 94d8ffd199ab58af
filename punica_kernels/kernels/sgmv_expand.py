"""SGMV expand (prefill): a tile of a segment's rows times one B tile, added into y.

Semantics:
    for l, B in enumerate(slices):
        off, n = offsets[l], B.shape[1]
        for i in range(len(seg_slots)):
            a, b, s = seg_starts[i], seg_starts[i+1], seg_slots[i]
            if s == -1:
                continue                     # y[a:b] unchanged
            r = ranks[s]
            y[a:b, off:off+n] += v[l, a:b, :r] @ B[s, :, :r].T   # fp32 accumulation
Only columns [0, ranks[s]) of B[s] and of v are read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._checks import check_expand, check_segments
from ._common import check_blocks, check_runnable, dot_in_fp32, expand_launches


@triton.jit
def _sgmv_expand_kernel(
    v_ptr, b_ptrs, b0_ptr, geo_ptr, starts_ptr, seg_slot_ptr, rank_ptr, y_ptr,
    R, L, M_BLOCKS, stride_vl, stride_vt, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
):
    # grid = (n_segments * M_BLOCKS, cdiv(max N_i, BLOCK_N), L)
    seg = tl.program_id(0) // M_BLOCKS
    mb = tl.program_id(0) % M_BLOCKS
    nb = tl.program_id(1)
    l = tl.program_id(2)
    s = tl.load(seg_slot_ptr + seg).to(tl.int64)
    if s < 0:
        return
    start = tl.load(starts_ptr + seg).to(tl.int64)
    end = tl.load(starts_ptr + seg + 1).to(tl.int64)
    m0 = start + mb * BLOCK_M
    if m0 >= end:
        return
    n = tl.load(geo_ptr + l)
    off = tl.load(geo_ptr + L + l)
    if nb * BLOCK_N >= n:
        return
    r = tl.load(rank_ptr + s)
    b_base = tl.load(b_ptrs + l).to(tl.pointer_type(b0_ptr.dtype.element_ty)) + s * n * R
    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    v_base = v_ptr + l.to(tl.int64) * stride_vl
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, r, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < r
        vt = tl.load(v_base + offs_m[:, None] * stride_vt + offs_r[None, :],
                     mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        bt = tl.load(b_base + offs_n[None, :].to(tl.int64) * R + offs_r[:, None],
                     mask=mask_n[None, :] & mask_r[:, None], other=0.0)
        if IEEE:
            acc += tl.dot(vt, bt.to(tl.float32), input_precision="ieee")
        else:
            # Half weights: round the fp32 intermediate tile to the weight dtype so the product
            # runs on tensor cores; accumulation stays fp32.
            acc += tl.dot(vt.to(b0_ptr.dtype.element_ty), bt)
    y_tile = y_ptr + offs_m[:, None] * stride_yt + off + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y_old = tl.load(y_tile, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_tile, (y_old + acc).to(y_ptr.dtype.element_ty), mask=mask)


def sgmv_expand_triton(v, lora_b, seg_starts, seg_slots, ranks, y, *, offsets=None,
                       max_segment_len=None, block_m: int = 32, block_n: int = 64, block_r: int = 16):
    """Launch SGMV expand, adding into y in place. Semantics: see the module docstring.

    Args:
        v: fp32 [T, R] (one stack) or [L, T, R] (a sequence of L stacks).
        lora_b: [S, N, R] stack or a sequence of [S, N_i, R] stacks (same dtype as y).
        seg_starts: [n+1] int32/int64; seg_slots: [n] int32/int64, -1 = no adapter.
        ranks: [S] int32/int64 (<= R).
        y: [T, width] fp16/bf16/fp32, contiguous; updated in place.
        offsets: first output column of each slice; default packs the slices side by side from 0.
        max_segment_len: longest segment; None means T (fixed launch shape, no device sync).
    Returns:
        y.
    Raises:
        TypeError / ValueError on a bad dtype, shape, device, contiguity, segment, slot or rank;
        RuntimeError where this process's kernels cannot run on y's device (_common.check_runnable).
    """
    args = check_expand(v, lora_b, ranks, y, offsets)
    check_segments(seg_starts, seg_slots, args.num_tokens, args.num_slots, y.device)
    check_blocks(minimum=16, block_m=block_m, block_n=block_n, block_r=block_r)
    check_runnable(y.device)
    T, R = args.num_tokens, args.max_rank
    n_seg = seg_slots.shape[0]
    max_len = T if max_segment_len is None else int(max_segment_len)
    if T == 0 or R == 0 or n_seg == 0 or max_len <= 0 or max(args.widths) == 0:
        return y
    m_blocks = triton.cdiv(max_len, block_m)
    for g, widths, ptrs, geo, vv in expand_launches(args):
        grid = (n_seg * m_blocks, triton.cdiv(max(widths), block_n), len(g))
        _sgmv_expand_kernel[grid](
            vv, ptrs, args.slices[g.start], geo, seg_starts, seg_slots, ranks, y,
            R, len(g), m_blocks, vv.stride(0), vv.stride(1), y.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, IEEE=dot_in_fp32(y.dtype),
        )
    return y
