"""Grouped expand (decode): one program per (slot, output tile) multiplies its slot's rows, a
tile of BLOCK_M at a time, by one B tile (tl.dot), so an adapter's B is read once per step
however many rows share it.

Semantics (as bgmv_expand):
    for l, B in enumerate(slices):
        off, n = offsets[l], B.shape[1]
        for t in range(T):
            s = token_slots[t]
            if s == -1:
                continue                     # y[t] unchanged
            r = ranks[s]
            y[t, off:off+n] += v[l, t, :r] @ B[s, :, :r].T      # fp32 accumulation
Only columns [0, ranks[s]) of B[s] and of v are used (loads round the rank up to 8 columns,
within R, for 16-byte loads; those past the rank are zeroed, so padding is never used). Each row of y is written by the programs
of its own slot only, one per output tile, so no two programs write one element.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._checks import check_expand
from ..metadata import DecodeGroups
from ._common import check_blocks, check_runnable, dot_in_fp32, expand_launches, next_pow2, slice_offsets
from .grouped_shrink import check_groups


@triton.jit
def _grouped_expand_kernel(
    v_ptr, b_offs, b0_ptr, geo_ptr, order_ptr, bounds_ptr, rank_ptr, y_ptr,
    R, L, stride_vl, stride_vt, stride_yt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, UNIT: tl.constexpr,
    IEEE: tl.constexpr,
):
    # grid = (S, cdiv(max N_i, BLOCK_N), L): fixed by S and the shapes, whatever the slots hold.
    s = tl.program_id(0)
    nb = tl.program_id(1)
    l = tl.program_id(2)
    start = tl.load(bounds_ptr + s)
    end = tl.load(bounds_ptr + s + 1)
    if start >= end:
        return
    n = tl.load(geo_ptr + l)
    off = tl.load(geo_ptr + L + l)
    if nb * BLOCK_N >= n:
        return  # narrower slices (GQA k, v) have fewer column tiles
    r = tl.load(rank_ptr + s)
    b_base = b0_ptr + tl.load(b_offs + l) * UNIT + s.to(tl.int64) * n * R  # _common.slice_offsets
    # Loads cover the rank rounded up to 8 columns (within R), a multiple the compiler can see,
    # so they are 16-byte wide; the columns past the rank are then zeroed, never used.
    r_load = tl.minimum((r + 7) // 8 * 8, R)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    v_base = v_ptr + l.to(tl.int64) * stride_vl
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < end
        rows = tl.load(order_ptr + offs_m, mask=mask_m, other=0)  # int64
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for r0 in range(0, r, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            mask_r = offs_r < r
            load_r = offs_r < r_load
            vt = tl.load(v_base + rows[:, None] * stride_vt + offs_r[None, :],
                         mask=mask_m[:, None] & load_r[None, :], other=0.0)
            vt = tl.where(mask_r[None, :], vt, 0.0)
            bt = tl.load(b_base + offs_n[None, :].to(tl.int64) * R + offs_r[:, None],
                         mask=mask_n[None, :] & load_r[:, None], other=0.0)
            bt = tl.where(mask_r[:, None], bt, 0.0)
            if IEEE:
                acc += tl.dot(vt, bt.to(tl.float32), input_precision="ieee")
            else:
                # Half weights: the fp32 intermediate tile rounded to the weight dtype, so the
                # product runs on tensor cores (as SGMV expand); accumulation stays fp32.
                acc += tl.dot(vt.to(b0_ptr.dtype.element_ty), bt)
        y_tile = y_ptr + rows[:, None] * stride_yt + off + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        y_old = tl.load(y_tile, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_tile, (y_old + acc).to(y_ptr.dtype.element_ty), mask=mask)


def grouped_expand_triton(v, lora_b, groups: DecodeGroups, ranks, y, *, offsets=None,
                          block_n: int = 64, block_r: int | None = None):
    """Launch the grouped expand, adding into y in place. Semantics: see the module docstring.

    Args:
        v: fp32 [T, R] (one stack) or [L, T, R] (a sequence of L stacks), e.g. the grouped
            shrink's output; rows of slot -1 are not read.
        lora_b: [S, N, R] stack or a sequence of [S, N_i, R] stacks (same dtype as y).
        groups: the rows grouped by slot (`group_decode_tokens` of their slots, S slots).
        ranks: [S] int32/int64, true rank of each slot (<= R).
        y: [T, width] fp16/bf16/fp32, contiguous; updated in place.
        offsets: first output column of each slice; default packs the slices side by side from 0.
    Returns:
        y.
    Raises:
        TypeError / ValueError on a bad dtype, shape, device, contiguity, rank or grouping;
        RuntimeError where this process's kernels cannot run on y's device (_common.check_runnable).
    """
    args = check_expand(v, lora_b, ranks, y, offsets)
    check_groups(groups, args.num_tokens, args.num_slots, y.device)
    check_blocks(minimum=16, block_n=block_n, **({} if block_r is None else {"block_r": block_r}))
    check_runnable(y.device)
    T, R, S = args.num_tokens, args.max_rank, args.num_slots
    if T == 0 or R == 0 or max(args.widths) == 0:
        return y
    if block_r is None:
        block_r = min(64, max(16, next_pow2(R)))
    # Row tiles up to 64, fewer for wide rank tiles: the accumulator and the operand tiles stay in
    # registers on sm_90 (bench/sass.py).
    block_m = min(64, max(16, 2048 // block_r), max(16, next_pow2(T)))
    for g, widths, _, geo, vv in expand_launches(args):
        offs, unit = slice_offsets(args.slices[g.start:g.stop])
        # num_stages=1: the rank loop makes one trip for R <= 64 (block_r covers it), so a
        # software pipeline would only hold registers.
        grid = (S, triton.cdiv(max(widths), block_n), len(g))
        _grouped_expand_kernel[grid](
            vv, offs, args.slices[g.start], geo, groups.order, groups.bounds, ranks, y,
            R, len(g), vv.stride(0), vv.stride(1), y.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, UNIT=unit,
            IEEE=dot_in_fp32(y.dtype), num_stages=1,
        )
    return y
