"""BGMV expand (decode): each token gathers its own adapter's B and adds into its row of y.

Semantics:
    for l, B in enumerate(slices):           # e.g. q, k, v of different widths, one launch
        off, n = offsets[l], B.shape[1]
        for t in range(T):
            s = token_slots[t]
            if s == -1:
                continue                     # y[t] unchanged
            r = ranks[s]
            y[t, off:off+n] += v[l, t, :r] @ B[s, :, :r].T      # fp32 accumulation
Only columns [0, ranks[s]) of B[s] (and of v) are read.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._checks import check_expand, check_token_slots
from ._common import check_blocks, check_runnable, expand_launches, next_pow2


@triton.jit
def _bgmv_expand_kernel(
    v_ptr, b_ptrs, b0_ptr, geo_ptr, slot_ptr, rank_ptr, y_ptr,
    R, L, stride_vl, stride_vt, stride_yt,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # grid = (T, cdiv(max N_i, BLOCK_N), L)
    t = tl.program_id(0)
    nb = tl.program_id(1)
    l = tl.program_id(2)
    s = tl.load(slot_ptr + t).to(tl.int64)
    if s < 0:
        return
    n = tl.load(geo_ptr + l)
    off = tl.load(geo_ptr + L + l)
    if nb * BLOCK_N >= n:
        return  # narrower slices (GQA k, v) have fewer column blocks
    r = tl.load(rank_ptr + s)
    b_base = tl.load(b_ptrs + l).to(tl.pointer_type(b0_ptr.dtype.element_ty)) + s * n * R
    v_row = v_ptr + l.to(tl.int64) * stride_vl + t.to(tl.int64) * stride_vt
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, r, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < r
        vv = tl.load(v_row + offs_r, mask=mask_r, other=0.0)
        b = tl.load(
            b_base + offs_n[:, None].to(tl.int64) * R + offs_r[None, :],
            mask=mask_n[:, None] & mask_r[None, :], other=0.0,
        ).to(tl.float32)
        acc += tl.sum(b * vv[None, :], axis=1)
    y_row = y_ptr + t.to(tl.int64) * stride_yt + off + offs_n
    y_old = tl.load(y_row, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_row, (y_old + acc).to(y_ptr.dtype.element_ty), mask=mask_n)


def bgmv_expand_triton(v, lora_b, token_slots, ranks, y, *, offsets=None,
                       block_n: int = 128, block_r: int | None = None):
    """Launch BGMV expand, adding into y in place. Semantics: see the module docstring.

    Args:
        v: fp32 [T, R] (one stack) or [L, T, R] (a sequence of L stacks), e.g. shrink's output.
        lora_b: [S, N, R] stack or a sequence of [S, N_i, R] stacks (same dtype as y).
        token_slots: [T] int32/int64, -1 = no adapter.
        ranks: [S] int32/int64, true rank of each slot (<= R).
        y: [T, width] fp16/bf16/fp32, contiguous; updated in place.
        offsets: first output column of each slice; default packs the slices side by side from 0.
    Returns:
        y.
    Raises:
        TypeError / ValueError on a bad dtype, shape, device, contiguity, slot or rank;
        RuntimeError where this process's kernels cannot run on y's device (_common.check_runnable).
    """
    args = check_expand(v, lora_b, ranks, y, offsets)
    check_token_slots(token_slots, args.num_tokens, args.num_slots, y.device)
    check_blocks(block_n=block_n, **({} if block_r is None else {"block_r": block_r}))
    check_runnable(y.device)
    T, R = args.num_tokens, args.max_rank
    if T == 0 or R == 0 or max(args.widths) == 0:
        return y
    if block_r is None:
        block_r = min(64, max(16, next_pow2(R)))
    for g, widths, ptrs, geo, vv in expand_launches(args):
        grid = (T, triton.cdiv(max(widths), block_n), len(g))
        _bgmv_expand_kernel[grid](
            vv, ptrs, args.slices[g.start], geo, token_slots, ranks, y,
            R, len(g), vv.stride(0), vv.stride(1), y.stride(0),
            BLOCK_N=block_n, BLOCK_R=block_r,
        )
    return y
