"""BGMV shrink (decode): each token gathers its own adapter's A.

Semantics:
    for l, A in enumerate(slices):           # one launch covers every slice
        for t in range(T):
            s = token_slots[t]
            if s == -1:
                v[l, t, :] = 0               # no adapter
            else:
                r = ranks[s]
                v[l, t, :r] = scales[s] * (x[t] @ A[s, :r, :].T)   # fp32 accumulation
                v[l, t, r:] = 0
Only rows [0, ranks[s]) of A[s] are read: the work per token is proportional to its own rank.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._checks import check_shrink, check_token_slots
from ._common import check_blocks, check_runnable, slice_tables


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr, a_ptrs, a0_ptr, slot_ptr, scale_ptr, rank_ptr, v_ptr,
    K, stride_xt, stride_as, stride_ar, stride_vl, stride_vt,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    # grid = (T, cdiv(R, BLOCK_R) * SPLIT_K, L): fixed for a batch size, whatever the slots hold.
    t = tl.program_id(0)
    rb = tl.program_id(1) // SPLIT_K
    ks = tl.program_id(1) % SPLIT_K
    l = tl.program_id(2)
    s = tl.load(slot_ptr + t).to(tl.int64)
    if s < 0:
        return  # v was zeroed by the launcher
    r = tl.load(rank_ptr + s)
    if rb * BLOCK_R >= r:
        return  # rank blocks past this adapter's rank do no work
    # 64-bit offsets: int32 row * stride overflows on long batches and silently corrupts.
    a_base = tl.load(a_ptrs + l).to(tl.pointer_type(a0_ptr.dtype.element_ty)) + s * stride_as
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < r
    k_span = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_lo = ks * k_span
    k_hi = tl.minimum(k_lo + k_span, K)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_hi
        xk = tl.load(x_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        a = tl.load(
            a_base + offs_r[:, None].to(tl.int64) * stride_ar + offs_k[None, :],
            mask=mask_r[:, None] & mask_k[None, :], other=0.0,
        ).to(tl.float32)
        acc += tl.sum(a * xk[None, :], axis=1)
    acc = acc * tl.load(scale_ptr + s)
    v_row = v_ptr + l.to(tl.int64) * stride_vl + t.to(tl.int64) * stride_vt
    if SPLIT_K == 1:
        tl.store(v_row + offs_r, acc, mask=mask_r)
    else:
        tl.atomic_add(v_row + offs_r, acc, mask=mask_r)


def bgmv_shrink_triton(x, lora_a, token_slots, scales, ranks, *, out=None,
                       block_r: int = 16, block_k: int = 256, split_k: int | None = None):
    """Launch BGMV shrink. Semantics: see the module docstring.

    Args:
        x: [T, K] fp16/bf16/fp32, contiguous.
        lora_a: [S, R, K] stack (same dtype as x), or a sequence of such stacks (one per slice).
        token_slots: [T] int32/int64, slot per token, -1 = no adapter.
        scales: [S] float32, applied here (alpha / r or the rsLoRA scale).
        ranks: [S] int32/int64, true rank of each slot (<= R).
        out: optional fp32 buffer of the returned shape; it is overwritten.
        block_r, block_k: tile sizes (powers of two).
        split_k: programs per token along K, partial sums added atomically; by default more
            splits for small batches so a decode step of few tokens still fills the GPU. It
            depends only on T, so the launch shape is fixed for a given batch size.
    Returns:
        v: fp32 [T, R] for one stack, [L, T, R] for a sequence of L stacks.
    Raises:
        TypeError / ValueError on a bad dtype, shape, device, contiguity, slot or rank;
        RuntimeError where this process's kernels cannot run on x's device (_common.check_runnable).
    """
    args = check_shrink(x, lora_a, scales, ranks, out)
    check_token_slots(token_slots, args.num_tokens, args.num_slots, x.device)
    check_blocks(block_r=block_r, block_k=block_k)
    check_runnable(x.device)
    v = args.out
    T, R, K, L = args.num_tokens, args.max_rank, args.hidden, len(args.slices)
    if T == 0 or R == 0 or K == 0:
        return v[0] if args.single else v
    if split_k is None:
        split_k = max(1, min(8, 64 // T, triton.cdiv(K, 4 * block_k)))
    ptrs, _ = slice_tables(args.slices, [0] * L, [0] * L)
    a0 = args.slices[0]
    grid = (T, triton.cdiv(R, block_r) * split_k, L)
    _bgmv_shrink_kernel[grid](
        x, ptrs, a0, token_slots, scales, ranks, v,
        K, x.stride(0), a0.stride(0), a0.stride(1), v.stride(0), v.stride(1),
        BLOCK_R=block_r, BLOCK_K=block_k, SPLIT_K=split_k,
    )
    return v[0] if args.single else v
