"""Attention in Triton over the paged KV cache: the fused RoPE + K/V write, decode attention
(split-KV, GQA-grouped; alone or with the RoPE + K/V write fused in) and chunked-prefill
attention (flash-style tiles, causal), both with an optional sliding window (Mistral, Qwen2,
Gemma 2/3, Phi-3) and logit soft-capping (Gemma 2).

The cache (engine.model.attention.KVCache): per layer `k_cache, v_cache [num_slots, Hkv, D]`,
a token's slot = block_id * block_size + offset; sequence b's logical block j is
block_tables[b, j]. Query head h reads KV head h // G, G = Hq / Hkv (HF's repeat_kv order, as
torch_ops' SDPA with enable_gqa).

Semantics:
    # rope_kv_write (qkv [T, (Hq + 2 Hkv) * D] = q heads | k heads | v heads)
    q, k, v = split(qkv)                                  # [T, H*, D]
    q, k = rotate_half_rope(q, k, cos[positions], sin[positions])
    for t: if slot_mapping[t] >= 0: k_cache[slot_mapping[t]] = k[t]; v_cache[...] = v[t]
    return q                                              # [T, Hq, D], contiguous

    # paged_decode_attention: one query per sequence, at position seq_lens[b] - 1
    for b, h: L = seq_lens[b]; slots = [block_tables[b, j // bs] * bs + j % bs for j < L]
        out[b, h] = softmax(scale * q[b, h] @ k_cache[slots, h // G].T) @ v_cache[slots, h // G]

    # paged_decode_attention_rope: both of the above on decode rows in one launch (q rotated
    # in registers, never stored; key seq_lens[b] - 1 is the new token's, written, then read)
    out = paged_decode_attention(rope_kv_write(qkv, ..., slot_mapping), ...)

    # paged_prefill_attention: sequence s's queries are rows query_start[s] .. query_start[s+1]
    for s, i, h: pos = context_lens[s] - q_len_s + i     # keys 0 .. pos are in the cache
        out[query_start[s] + i, h] = softmax over keys 0..pos (as above)

    # Both, with softcap and sliding_window (each None = off), as Hugging Face's Gemma 2/3,
    # Mistral and Phi-3: a query at position p (decode: seq_lens[b] - 1) scores key j as
        s = scale * q @ k_j;  if softcap: s = softcap * tanh(s / softcap)   # before masking
    # and attends only to keys with  p - sliding_window < j <= p  (sliding_window keys, itself
    # included). The cache keeps every key; keys before the window are never read: decode starts
    # its keys (and its splits) at max(0, L - window), prefill skips each query tile's key tiles
    # before its first query's window. A window covering the block table's capacity is full
    # attention (the kernels' full-attention build runs).

Softmax statistics and the value sums are fp32 whatever the cache dtype; outputs are in q's
dtype. Every output element is written by exactly one program: the prefill kernel's (query tile,
head) programs each their own rows. Decode is one launch of (sequence, KV head, split) programs;
a sequence of n keys uses cdiv(n, split_min_tokens) splits, at most the grid's NUM_SPLITS, and
the programs of splits it does not use return at once. With one split the program writes its
heads' output rows directly; with several each writes its disjoint rows of fp32 partials
(max, sum, weighted values), then counts itself done with one atomic add (acquire-release) on its
(sequence, KV head) counter, and the program whose count completes the set combines the partials
in split order, writes the output rows and zeroes the counter (punica_kernels' `_common.zeroed_counters`). The result is
deterministic: which program combines varies, what it sums and in which order does not. The fused
decode (paged_decode_attention_rope) writes each row's new K and V (one KV head's row per
program) from the (sequence, KV head)'s split whose keys end with the new one, which alone reads
that slot, after a barrier; every split rotates its own q heads.

Window and soft-cap are compile-time switches (SLIDING, SOFTCAP) with runtime values (the window
size, the cap): with both off the kernels build to the same machine code as plain causal
attention, and one build serves every window size.

Alignment: every load reads runs of contiguous head_dim elements. Cache rows start at
slot * Hkv * D + h * D elements and q/qkv rows at multiples of D, so with D * itemsize a multiple
of 16 bytes (D = 32, 64, 128 in any 2- or 4-byte dtype) each run starts 16-byte aligned provided
the base pointer is: torch's allocators return 256-byte-aligned storage, and Triton specializes
pointer arguments on 16-byte alignment and integer strides on divisibility by 16 at launch, so
it emits 16-byte vector loads exactly when those facts hold and narrower ones otherwise (a view
at an odd offset is still read correctly, only more slowly). RoPE's partner elements (d +- D/2)
are runs of D/2 starting at multiples of D/2: aligned likewise for D/2 * itemsize.

Runs on CUDA tensors (compiled) or on CPU tensors under the Triton interpreter
(TRITON_INTERPRET=1 when this module is imported); punica_kernels.kernels._common.check_runnable refuses a mismatch.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from punica_kernels.kernels._common import (check_blocks, common_device, device_name, dot_in_fp32, next_pow2,
                                            zeroed_counters)

#: How this module's kernels are named in errors.
_KERNELS = "engine.backends.triton.attention"


# ---------------------------------------------------------------------------------------------
# Launch configurations, as data.
#
# Key: (device name, kernel, head_dim); head_dim None = any. Lookup order: the device's exact
# head_dim, the device's any, then "default" likewise. The device name is torch.cuda's name
# ("NVIDIA H100 80GB HBM3"), or "interpreter" for CPU tensors. Add a tuned device by adding its
# keys; a device never tuned takes "default".
#   block_m / block_n: query / key tile sizes (powers of two >= 16, tl.dot's minimum);
#   block_rows: (token, head) pairs per rope_kv_write program (the interpreter pays per program);
#   split_min_tokens: keys per decode split worth its partial-output traffic (a sequence of n
#     keys uses cdiv(n, split_min_tokens) splits, at most the launch's count);
#   max_splits: cap on the decode launch's split count.
# The defaults follow the shapes: 64-key tiles keep a [G, 64] score tile and two [64, D] K/V
# tiles in registers for D <= 128; the interpreter's small tiles make the tests' short
# sequences cross tile and split boundaries.
KERNEL_CONFIGS: dict[tuple[str, str, int | None], dict] = {
    ("default", "rope_kv_write", None): dict(block_rows=4, num_warps=4),
    ("interpreter", "rope_kv_write", None): dict(block_rows=64, num_warps=4),
    ("default", "decode", None): dict(block_n=64, num_warps=4, num_stages=2,
                                      split_min_tokens=256, max_splits=16),
    ("default", "prefill", None): dict(block_m=64, block_n=64, num_warps=4, num_stages=2),
    ("default", "prefill", 128): dict(block_m=64, block_n=32, num_warps=4, num_stages=2),
    # Gemma's head_dim 256: the 64 x 64 default spills on sm_90 (255 registers, 48-64 bytes
    # spilled); 64 x 32 builds without spills (about 240 registers), window and soft-cap on or
    # off. Chosen from the sm_90 build, not timed.
    ("default", "prefill", 256): dict(block_m=64, block_n=32, num_warps=4, num_stages=2),
    ("interpreter", "decode", None): dict(block_n=16, num_warps=4, num_stages=1,
                                          split_min_tokens=16, max_splits=16),
    ("interpreter", "prefill", None): dict(block_m=16, block_n=16, num_warps=4, num_stages=1),
}


def kernel_config(device: torch.device, kernel: str, head_dim: int) -> dict:
    """The launch configuration of `kernel` for `head_dim` on `device` (see KERNEL_CONFIGS)."""
    name = device_name(device)
    for key in ((name, kernel, head_dim), (name, kernel, None),
                ("default", kernel, head_dim), ("default", kernel, None)):
        if key in KERNEL_CONFIGS:
            return KERNEL_CONFIGS[key]
    raise KeyError(f"no launch configuration for kernel {kernel!r}")


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 for the interpreter (programs run one by one)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int, *,
                      split_min_tokens: int, max_splits: int) -> int:
    """The decode launch's split count: the most partitions a sequence's keys are split into
    (each sequence uses only as many as its own length needs, see paged_decode_attention).

    Unsplit there are batch * num_kv_heads programs; while that fills every SM once there is
    nothing to gain. Otherwise split just enough to give each SM a program, but never into
    partitions shorter than `split_min_tokens` of the longest context (each split costs a
    partial output row and a reduction read), and at most `max_splits`.
    """
    programs = batch * num_kv_heads
    if programs <= 0 or programs >= num_sms:
        return 1
    by_occupancy = triton.cdiv(num_sms, programs)
    by_length = max(1, max_seq_len // max(1, split_min_tokens))
    return max(1, min(by_occupancy, by_length, max_splits))


# ---------------------------------------------------------------------------------------------
# RoPE + K/V cache write


@triton.jit
def _rope_kv_write_kernel(
    qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, T,
    stride_qkv_t, stride_cos, stride_sin, stride_qo_t, stride_k_slot, stride_v_slot,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # grid = (cdiv(T * (Hq + 2 Hkv), BLOCK_R),): BLOCK_R (token, head) pairs of the flattened
    # token-major list, so a program may span tokens. Each (token, head) is one program's: q_out
    # rows are the token's own, and a cache slot is written only by the token that owns it
    # (distinct slots per step: the block manager's).
    HALF: tl.constexpr = HEAD_DIM // 2
    H_ALL: tl.constexpr = NUM_HEADS + 2 * NUM_KV_HEADS
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    valid = r < T * H_ALL
    t = r // H_ALL
    h = r % H_ALL
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    pos = tl.load(pos_ptr + t, mask=valid, other=0)
    slot = tl.load(slot_ptr + t, mask=valid, other=-1)  # int64: slot * stride must not wrap

    # Heads sit D elements apart in the row, so each half-head run starts at a multiple of D / 2.
    row = qkv_ptr + t[:, None] * stride_qkv_t + h[:, None] * HEAD_DIM + offs_d[None, :]
    m2 = valid[:, None] & mask_d[None, :]
    x1 = tl.load(row, mask=m2, other=0.0)
    x2 = tl.load(row + HALF, mask=m2, other=0.0)
    c_row = cos_ptr + pos[:, None] * stride_cos + offs_d[None, :]
    s_row = sin_ptr + pos[:, None] * stride_sin + offs_d[None, :]
    c1 = tl.load(c_row, mask=m2, other=0.0).to(tl.float32)
    c2 = tl.load(c_row + HALF, mask=m2, other=0.0).to(tl.float32)
    s1 = tl.load(s_row, mask=m2, other=0.0).to(tl.float32)
    s2 = tl.load(s_row + HALF, mask=m2, other=0.0).to(tl.float32)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    # rotate_half(x) = [-x2, x1]:  out = x * cos + rotate_half(x) * sin
    r1 = (x1f * c1 - x2f * s1).to(x1.dtype)
    r2 = (x2f * c2 + x1f * s2).to(x1.dtype)

    is_q = valid & (h < NUM_HEADS)
    is_k = valid & (h >= NUM_HEADS) & (h < NUM_HEADS + NUM_KV_HEADS)
    is_v = valid & (h >= NUM_HEADS + NUM_KV_HEADS)
    write = slot >= 0  # a negative slot marks a padding token: nothing written

    q_dst = q_out_ptr + t[:, None] * stride_qo_t + h[:, None] * HEAD_DIM + offs_d[None, :]
    mq = is_q[:, None] & mask_d[None, :]
    tl.store(q_dst, r1, mask=mq)
    tl.store(q_dst + HALF, r2, mask=mq)
    k_dst = k_cache_ptr + slot[:, None] * stride_k_slot + (h - NUM_HEADS)[:, None] * HEAD_DIM + offs_d[None, :]
    mk = (is_k & write)[:, None] & mask_d[None, :]
    tl.store(k_dst, r1, mask=mk)
    tl.store(k_dst + HALF, r2, mask=mk)
    v_dst = (v_cache_ptr + slot[:, None] * stride_v_slot
             + (h - NUM_HEADS - NUM_KV_HEADS)[:, None] * HEAD_DIM + offs_d[None, :])
    mv = (is_v & write)[:, None] & mask_d[None, :]
    tl.store(v_dst, x1, mask=mv)
    tl.store(v_dst + HALF, x2, mask=mv)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 3 or c.shape[1:] != (num_kv_heads, head_dim):
            raise ValueError(f"{name} must be [num_slots, {num_kv_heads}, {head_dim}], got {tuple(c.shape)}")
        if c.stride(2) != 1 or c.stride(1) != head_dim:
            raise ValueError(f"{name}'s (head, dim) plane must be contiguous")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must have one shape and dtype")


def _check_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """rope_kv_write's and paged_decode_attention_rope's checks of their RoPE + K/V write
    inputs; returns the row count T."""
    D = head_dim
    if D % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {D}")
    width = (num_heads + 2 * num_kv_heads) * D
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, {width}] with contiguous rows, got {tuple(qkv.shape)}")
    for name, tab in (("cos", cos), ("sin", sin)):
        if tab.dim() != 2 or tab.shape[1] != D or tab.stride(1) != 1:
            raise ValueError(f"{name} must be [P, {D}] with contiguous rows")
    T = qkv.shape[0]
    for name, idx in (("positions", positions), ("slot_mapping", slot_mapping)):
        if idx.shape != (T,) or idx.dtype != torch.int64:
            raise ValueError(f"{name} must be int64 [{T}]")
    _check_cache(k_cache, v_cache, num_kv_heads, D)
    if k_cache.dtype != qkv.dtype:
        raise ValueError(f"cache dtype {k_cache.dtype} differs from qkv's {qkv.dtype}")
    return T


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Rotate q and k (HF rotate-half RoPE), write rotated k and v to their cache slots, return
    rotated q. One launch. Semantics: see the module docstring.

    Args:
        qkv: [T, (Hq + 2 Hkv) * D], unrotated q | k | v heads; rows contiguous (row stride free).
        cos, sin: [P, D] tables (engine.model.layers.RotaryEmbedding), any float dtype.
        positions: [T] int64 (< P).
        k_cache, v_cache: [num_slots, Hkv, D] in qkv's dtype.
        slot_mapping: [T] int64; a negative slot writes nothing (a padding token).
    Returns:
        q: [T, Hq, D] contiguous, in qkv's dtype (rotated in fp32, rounded once).
    """
    D = head_dim
    T = _check_rope(qkv, cos, sin, positions, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, D)
    device = common_device(qkv, cos, sin, positions, k_cache, v_cache, slot_mapping, what=_KERNELS)
    q = torch.empty(T, num_heads, D, dtype=qkv.dtype, device=device)
    if T == 0:
        return q
    cfg = kernel_config(device, "rope_kv_write", D)
    block_r = cfg["block_rows"]
    check_blocks(block_rows=block_r)
    grid = (triton.cdiv(T * (num_heads + 2 * num_kv_heads), block_r),)
    _rope_kv_write_kernel[grid](
        qkv, cos, sin, positions, slot_mapping, q, k_cache, v_cache, T,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), k_cache.stride(0), v_cache.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=D,
        BLOCK_R=block_r, BLOCK_HALF=next_pow2(D // 2), num_warps=cfg["num_warps"],
    )
    return q


# ---------------------------------------------------------------------------------------------
# Decode attention


@triton.jit
def _tanh(x):
    """tanh of fp32 x from exp alone: Triton has no tanh in every version, and libdevice's does
    not run in the interpreter. (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1] never overflows,
    but 1 - e cancels near 0, so below |x| = 1/4 the Taylor series to x^9 (truncation < 1e-8
    relative) takes over: within 5 fp32 ulps of tanh everywhere."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    t = (1.0 - e) / (1.0 + e)
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    return tl.where(a < 0.25, series, tl.where(x < 0, -t, t))


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, bt_row, offs_n, mask_n, keep, kv_col, mask_d, block_size,
                 stride_k_slot, stride_v_slot, scale, softcap,
                 IEEE: tl.constexpr, SOFTCAP: tl.constexpr, EMPTY_ROWS: tl.constexpr):
    """One key tile of an online softmax: keys offs_n (mask_n: those that exist) read through the
    block-table row `bt_row`, scores of q [rows, D] against them (soft-capped when SOFTCAP) kept
    where `keep` ([rows or 1, BLOCK_N]), folded into the running (max, sum, output) =
    (m_i, l_i, acc), which it returns. Table entries are read only for existing keys: entries
    past a sequence's last block may be garbage and are never dereferenced.

    Without EMPTY_ROWS the caller guarantees every tile keeps a key per row, so the running
    maximum is finite from the first tile on. With it (sliding windows: a tile may lie wholly
    before or after a row's window) a row's maximum may still be -inf: its exponentials are
    taken against 0 instead (exp(-inf) = 0, where -inf - -inf would be NaN), and the maximum
    itself stays -inf so that the row's first real key sets it."""
    blk = tl.load(bt_row + offs_n // block_size, mask=mask_n, other=0).to(tl.int64)
    slot = blk * block_size + offs_n % block_size
    m_nd = mask_n[:, None] & mask_d[None, :]
    k = tl.load(k_ptr + slot[:, None] * stride_k_slot + kv_col, mask=m_nd, other=0.0)
    v = tl.load(v_ptr + slot[:, None] * stride_v_slot + kv_col, mask=m_nd, other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if SOFTCAP:
        s = softcap * _tanh(s * (scale / softcap))
    else:
        s = s * scale
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if EMPTY_ROWS:
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
    else:
        m_ref = m_new
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _combine_splits(mid_o_ptr, mid_m_ptr, mid_l_ptr, b, heads, mask_g, offs_d, mask_d, n_split,
                    HEAD_DIM: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """Attention of `heads` of sequence b from its first n_split partial rows, in split order:
    sum_s w_s acc_s / sum_s w_s l_s with w_s = exp(m_s - max m), fp32 [BLOCK_G, BLOCK_D]. The
    sums run split by split, so a row's result depends only on its own split count, never on the
    launch's bound. The rows were written by other programs of this launch: loads read L2 (".cg"),
    never a stale line of this SM's L1."""
    rows = (b * NUM_HEADS + heads) * NUM_SPLITS  # each head's split 0
    m_max = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    for s in range(n_split):
        m_max = tl.maximum(m_max, tl.load(mid_m_ptr + rows + s, mask=mask_g, other=float("-inf"),
                                          cache_modifier=".cg"))
    # Empty splits (m = -inf) weigh exp(-inf) = 0; a row with no key at all subtracts 0 instead of
    # -inf (-inf - -inf is NaN) and ends with denom 0: zeros.
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)
    denom = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for s in range(n_split):
        m = tl.load(mid_m_ptr + rows + s, mask=mask_g, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(mid_l_ptr + rows + s, mask=mask_g, other=0.0, cache_modifier=".cg")
        o = tl.load(mid_o_ptr + (rows + s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=mask_g[:, None] & mask_d[None, :], other=0.0, cache_modifier=".cg")
        w = tl.exp(m - m_max)
        denom += w * l
        acc += w[:, None] * o
    return acc / tl.where(denom > 0, denom, 1.0)[:, None]


@triton.jit
def _rope_rotate(x, x_partner, c, s, lo):
    """Rotate-half RoPE of x in fp32, rounded once to x's dtype: x_partner holds x's element
    D/2 away (x[d + D/2] where `lo`, d < D/2, else x[d - D/2]), c and s the fp32 cos and sin at
    d. The same expressions as _rope_kv_write_kernel's r1 (lo) and r2, so the same bits."""
    xf = x.to(tl.float32)
    pf = x_partner.to(tl.float32)
    return tl.where(lo, xf * c - pf * s, xf * c + pf * s).to(x.dtype)


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, mid_o_ptr, mid_m_ptr, mid_l_ptr, cnt_ptr,
    cos_ptr, sin_ptr, pos_ptr, slot_ptr,
    scale, block_size, max_blocks, split_min_tokens,
    stride_qb, stride_qh, stride_k_slot, stride_v_slot, stride_btb, stride_ob, stride_oh, stride_cos, stride_sin,
    window, softcap,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, ROPE: tl.constexpr,
):
    # grid = (B, Hkv, NUM_SPLITS): the G query heads sharing KV head `kvh` of sequence b, over
    # split `sp` of its keys. K/V tiles are read once for the whole group. NUM_SPLITS is only a
    # bound: the sequence uses n_split = clamp(cdiv(keys, split_min_tokens), 1, NUM_SPLITS) of
    # them, from its own length (the keys its query sees), so a short row in a grid sized for a
    # long one (a CUDA graph's fixed table width) costs one program, not NUM_SPLITS.
    # With ROPE, q_ptr is the layer's qkv rows (q | k | v heads, unrotated; stride_qh = HEAD_DIM)
    # and cos/sin/pos/slot are read: every program rotates its q heads in registers, and the
    # program whose keys end with the new token's rotates that key and writes it and its value
    # to the row's slot before its loop reads it (below). Without ROPE those four pointers and
    # two strides are unused.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    # Never past the table's capacity: entries beyond it do not exist.
    seq_len = tl.minimum(tl.load(lens_ptr + b), max_blocks * block_size)
    if SLIDING:
        # The query, at seq_len - 1, sees keys seq_len - window .. seq_len - 1, every one: the
        # keys before cost no tile and no split, and no key needs a window mask.
        kv_start = tl.maximum(seq_len - window, 0)
    else:
        kv_start = 0
    keys = seq_len - kv_start
    if NUM_SPLITS == 1:
        n_split = 1
    else:
        n_split = tl.minimum(tl.maximum(tl.cdiv(keys, split_min_tokens), 1), NUM_SPLITS)
        if sp >= n_split:
            return  # a split this sequence does not use: it writes nothing and is not counted
    # Each used split's range is proportional to the keys, in whole key tiles.
    part = tl.cdiv(tl.cdiv(keys, n_split), BLOCK_N) * BLOCK_N
    start = kv_start + sp * part
    end = tl.minimum(seq_len, start + part)

    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < G
    heads = kvh * G + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    mask_q = mask_g[:, None] & mask_d[None, :]
    q = tl.load(q_rows + offs_d[None, :], mask=mask_q, other=0.0)
    kv_col = kvh * HEAD_DIM + offs_d[None, :]
    if ROPE:
        HALF: tl.constexpr = HEAD_DIM // 2
        NUM_KV_HEADS: tl.constexpr = NUM_HEADS // G
        lo = offs_d < HALF
        partner = tl.where(lo, offs_d + HALF, offs_d - HALF)
        pos = tl.load(pos_ptr + b)
        c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos * stride_sin + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        q = _rope_rotate(q, tl.load(q_rows + partner[None, :], mask=mask_q, other=0.0), c[None, :], s[None, :],
                         lo[None, :])
        # The new token's key is key seq_len - 1, in the one split whose range ends there (the
        # last that has keys): that program writes the key and its value (one writer per
        # sequence and KV head; none for a negative slot, a padding row), and no other program
        # reads that slot. It reads it back in its own loop after the barrier, so the loop is the
        # unfused kernel's: tiles read from the cache only. (Taking the new key from registers
        # in the tile instead costs about 90 registers on sm_90: the select between load and
        # tl.dot, or a peeled last tile, keeps K/V tiles out of the pipelined shared-memory path.)
        slot = tl.load(slot_ptr + b)
        if (slot >= 0) & (start < end) & (end == seq_len):
            k_row = q_ptr + b * stride_qb + (NUM_HEADS + kvh) * HEAD_DIM
            new_k = _rope_rotate(tl.load(k_row + offs_d, mask=mask_d, other=0.0),
                                 tl.load(k_row + partner, mask=mask_d, other=0.0), c, s, lo)
            new_v = tl.load(k_row + NUM_KV_HEADS * HEAD_DIM + offs_d, mask=mask_d, other=0.0)
            tl.store(k_ptr + slot * stride_k_slot + kvh * HEAD_DIM + offs_d, new_k, mask=mask_d)
            tl.store(v_ptr + slot * stride_v_slot + kvh * HEAD_DIM + offs_d, new_v, mask=mask_d)
        # Every thread's stores before any thread's loads (a CTA barrier orders global memory too).
        tl.debug_barrier()
    if IEEE:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        # Every tile holds at least one key < end, so the running maximum stays finite.
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, bt_ptr + b * stride_btb, offs_n, mask_n,
                                     mask_n[None, :], kv_col, mask_d, block_size, stride_k_slot, stride_v_slot,
                                     scale, softcap, IEEE, SOFTCAP, False)

    out_mask = mask_g[:, None] & mask_d[None, :]
    out_rows = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    if n_split == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no keys (seq_len 0): zeros
        tl.store(out_rows, o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials [B, Hq, NUM_SPLITS, (D)], fp32: this program's rows are (b, its heads, sp).
        row = (b * NUM_HEADS + heads) * NUM_SPLITS + sp
        tl.store(mid_m_ptr + row, m_i, mask=mask_g)
        tl.store(mid_l_ptr + row, l_i, mask=mask_g)
        tl.store(mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
        # Every thread's stores precede the count (the barrier), and the count releases them to
        # the program that sees it reach n_split; that program acquires them with it and combines.
        tl.debug_barrier()
        counter = cnt_ptr + b * tl.num_programs(1) + kvh
        if tl.atomic_add(counter, 1, sem="acq_rel") == n_split - 1:
            o = _combine_splits(mid_o_ptr, mid_m_ptr, mid_l_ptr, b, heads, mask_g, offs_d, mask_d, n_split,
                                HEAD_DIM, NUM_HEADS, NUM_SPLITS, BLOCK_G, BLOCK_D)
            tl.store(out_rows, o.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.store(counter, 0)  # zero again for the next launch: no fill launch before it


def _variant_args(sliding_window: int | None, softcap: float | None, capacity: int) -> dict:
    """The decode and prefill kernels' window and soft-cap arguments: the SLIDING and SOFTCAP
    switches and their runtime values (unused when off). A window of at least the block table's
    capacity (`capacity` = max_blocks * block_size keys) hides no key a sequence can have, so the
    full-attention build runs for it."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive finite float or None, got {softcap!r}")
    sliding = sliding_window is not None and sliding_window < capacity
    return dict(window=sliding_window if sliding else 0, softcap=0.0 if softcap is None else float(softcap),
                SLIDING=sliding, SOFTCAP=softcap is not None)


def _check_tables(block_tables: torch.Tensor, rows: int, lens: torch.Tensor, lens_name: str) -> None:
    if block_tables.dim() != 2 or block_tables.shape[0] != rows or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32 [{rows}, max_blocks], got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables' rows must be contiguous")
    if lens.shape != (rows,) or lens.dtype != torch.int32:
        raise ValueError(f"{lens_name} must be int32 [{rows}]")


def _check_q(q: torch.Tensor, k_cache: torch.Tensor, name: str) -> tuple[int, int, int]:
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"{name} must be [rows, Hq, D] with contiguous heads, got {tuple(q.shape)}")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"{name} dtype {q.dtype} differs from the cache's {k_cache.dtype}")
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    if k_cache.dim() != 3 or k_cache.shape[2] != d or hq % hkv:
        raise ValueError(f"q heads {hq} x {d} do not fit the cache's {tuple(k_cache.shape[1:])} "
                         "(Hq must be a multiple of Hkv)")
    return n, hq, d


def _output(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The attention kernels' output: `out` checked against what they write (shape, dtype,
    device, unit stride along the head dimension; rows and heads at any stride), or a new tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device or (out.numel() and out.stride(2) != 1):
        raise ValueError(f"out must be {dtype} {list(shape)} on {device} with a unit stride along its last "
                         f"dimension, not {out.dtype} {list(out.shape)} on {out.device} strides {out.stride()}")
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                           scale: float, *, num_splits: int | None = None,
                           max_seq_len: int | None = None, sliding_window: int | None = None,
                           softcap: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over the paged cache: each sequence's query attends to its first
    seq_lens[b] cached tokens (the new token's K/V already written), or with a sliding window to
    the last min(seq_lens[b], sliding_window) of them. One launch. Semantics: see the module
    docstring.

    Args:
        q: [B, Hq, D] rotated queries (heads contiguous), in the cache's dtype.
        k_cache, v_cache: [num_slots, Hkv, D].
        block_tables: [B, max_blocks] int32; entries past a sequence's last block are never read,
            so they may hold anything, and max_blocks may be wider than any sequence needs.
        seq_lens: [B] int32, tokens to attend to (> 0; 0 yields a zero row; values past
            max_blocks * block_size are read as that capacity).
        num_splits: the most partitions of a sequence's keys (the grid's third dimension): a
            sequence seeing n keys uses min(num_splits, max(1, cdiv(n, split_min_tokens))) of
            them (this device's configuration), one program each, the last to finish combining
            them; None: `choose_num_splits` with this device's configuration.
        max_seq_len: a host-side upper bound of seq_lens, used only to choose num_splits (no
            device read), in power-of-two buckets so that few launch configurations arise;
            None: max_blocks * block_size.
        sliding_window: keys a query sees, itself included (HF's `sliding_window`); None: all.
            The splits partition only those keys, so both bounds are capped by the window.
        softcap: scores become softcap * tanh(scores / softcap) (HF's
            `attn_logit_softcapping`); None: unchanged.
        out: where to write the result ([B, Hq, D] in q's dtype on its device, unit stride
            along D: a caller's rows of a larger output, written in place); None: a new tensor.
    Returns:
        out: [B, Hq, D] in q's dtype.
    """
    B, Hq, D = _check_q(q, k_cache, "q")
    _check_cache(k_cache, v_cache, k_cache.shape[1], D)
    _check_tables(block_tables, B, seq_lens, "seq_lens")
    device = common_device(q, k_cache, v_cache, block_tables, seq_lens, what=_KERNELS)
    out = _output(out, (B, Hq, D), q.dtype, device)
    return _launch_decode(q, q.stride(0), q.stride(1), Hq, k_cache, v_cache, block_tables, seq_lens, block_size,
                          scale, out, None, num_splits=num_splits, max_seq_len=max_seq_len,
                          sliding_window=sliding_window, softcap=softcap)


def paged_decode_attention_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                                k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, scale: float,
                                num_heads: int, num_kv_heads: int, head_dim: int, *, num_splits: int | None = None,
                                max_seq_len: int | None = None, sliding_window: int | None = None,
                                softcap: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """rope_kv_write followed by paged_decode_attention on decode rows, in one launch: each
    row's q heads and new key are rotated in registers (as rope_kv_write rotates them: fp32,
    rounded once to qkv's dtype), the new key and value are written to slot_mapping[b] (nothing
    for a negative slot), and the row's query attends to its first seq_lens[b] keys through its
    block table, the last of which, seq_lens[b] - 1, is the new token's. The cache afterwards
    and the output have the same bits as the two launches' (the same values, summed in the same
    order); the rotated q is not stored.

        q, k, v = rotate(split(qkv), cos[positions], sin[positions])   # as rope_kv_write
        for b: if slot_mapping[b] >= 0: k_cache[slot_mapping[b]] = k[b]; v_cache[...] = v[b]
        out = paged_decode_attention(q, ...)     # key seq_lens[b] - 1 of row b = (k[b], v[b])

    Within the launch each slot_mapping[b] is written by one program, the one whose split of
    row b's keys ends with key seq_lens[b] - 1, which reads it back after a barrier; so the
    table must map that key to slot_mapping[b], and no other row's keys may include that slot
    (the engine's: it lies in its own sequence's last block, never shared, and CUDA-graph
    padding rows, length 1 over the sink block, read only their own new key).

    Args:
        qkv: [B, (Hq + 2 Hkv) * D], the decode rows' unrotated q | k | v heads; rows contiguous
            (row stride free: the first rows of a step's qkv).
        cos, sin: [P, D] tables (engine.model.layers.RotaryEmbedding), any float dtype.
        positions: [B] int64 (< P), each new token's position (the engine's: seq_lens[b] - 1).
        k_cache, v_cache: [num_slots, Hkv, D] in qkv's dtype.
        slot_mapping: [B] int64, the new tokens' slots; a negative slot writes nothing (a
            padding row: its output is whatever the cache holds, as with rope_kv_write).
        block_tables, seq_lens (>= 1; a 0 row writes nothing and yields zeros), block_size, scale,
            num_splits, max_seq_len, sliding_window, softcap, out: as paged_decode_attention's.
    Returns:
        out: [B, Hq, D] in qkv's dtype.
    """
    B = _check_rope(qkv, cos, sin, positions, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    _check_tables(block_tables, B, seq_lens, "seq_lens")
    device = common_device(qkv, cos, sin, positions, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                           what=_KERNELS)
    out = _output(out, (B, num_heads, head_dim), qkv.dtype, device)
    return _launch_decode(qkv, qkv.stride(0), head_dim, num_heads, k_cache, v_cache, block_tables, seq_lens,
                          block_size, scale, out, (cos, sin, positions, slot_mapping), num_splits=num_splits,
                          max_seq_len=max_seq_len, sliding_window=sliding_window, softcap=softcap)


def _launch_decode(q: torch.Tensor, stride_qb: int, stride_qh: int, Hq: int, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                   scale: float, out: torch.Tensor, rope: tuple | None, *, num_splits: int | None,
                   max_seq_len: int | None, sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """The decode launch of paged_decode_attention (rope None: q [B, Hq, D] rotated queries) and
    of paged_decode_attention_rope (rope = (cos, sin, positions, slot_mapping): q is the qkv rows),
    on checked inputs; returns out."""
    B = out.shape[0]
    D = out.shape[2]
    device = out.device
    Hkv = k_cache.shape[1]
    if B == 0:
        return out
    cfg = kernel_config(device, "decode", D)
    block_n = cfg["block_n"]
    check_blocks(minimum=16, block_n=block_n)
    max_blocks = block_tables.shape[1]
    variant = _variant_args(sliding_window, softcap, max_blocks * block_size)
    if num_splits is None:
        bound = next_pow2(max_blocks * block_size if max_seq_len is None else max_seq_len)
        if variant["SLIDING"]:
            bound = min(bound, variant["window"])  # keys any query sees
        num_splits = choose_num_splits(B, Hkv, bound, _num_sms(device),
                                       split_min_tokens=cfg["split_min_tokens"], max_splits=cfg["max_splits"])
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    G = Hq // Hkv
    if num_splits > 1:
        mid_o = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=device)
        mid_m = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=device)
        mid_l = torch.empty_like(mid_m)
        counters = zeroed_counters(device, B * Hkv)
    else:
        mid_o = mid_m = mid_l = counters = out  # not touched by the single-split kernel
    # Without RoPE the four RoPE pointers are stand-ins (never read) and their strides 0.
    cos, sin, positions, slot_mapping = rope if rope is not None else (q, q, q, q)
    _decode_kernel[(B, Hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, mid_o, mid_m, mid_l, counters,
        cos, sin, positions, slot_mapping,
        scale, block_size, max_blocks, cfg["split_min_tokens"],
        stride_qb, stride_qh, k_cache.stride(0), v_cache.stride(0), block_tables.stride(0),
        out.stride(0), out.stride(1), cos.stride(0) if rope else 0, sin.stride(0) if rope else 0, **variant,
        G=G, HEAD_DIM=D, NUM_HEADS=Hq, NUM_SPLITS=num_splits,
        BLOCK_G=max(16, next_pow2(G)), BLOCK_D=max(16, next_pow2(D)), BLOCK_N=block_n, IEEE=dot_in_fp32(q.dtype),
        ROPE=rope is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


# ---------------------------------------------------------------------------------------------
# Prefill attention


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, qs_ptr, ctx_ptr, out_ptr,
    scale, block_size, max_blocks, M_BLOCKS,
    stride_qt, stride_qh, stride_k_slot, stride_v_slot, stride_btb, stride_ot, stride_oh,
    window, softcap,
    G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
):
    # grid = (S * M_BLOCKS, Hq): query tile `mb` of sequence `seq`, head h (KV head h // G).
    seq = tl.program_id(0) // M_BLOCKS
    mb = tl.program_id(0) % M_BLOCKS
    h = tl.program_id(1)
    kvh = h // G
    q_start = tl.load(qs_ptr + seq)
    q_len = tl.load(qs_ptr + seq + 1) - q_start
    m0 = mb * BLOCK_M
    if m0 >= q_len:
        return  # a shorter chunk than the longest
    prefix = tl.load(ctx_ptr + seq) - q_len  # cached tokens before the chunk
    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < q_len
    q_pos = prefix + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if IEEE:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys up to this tile's last query position (causal), capped by the table's capacity.
    kv_end = tl.minimum(prefix + tl.minimum(m0 + BLOCK_M, q_len), max_blocks * block_size)
    kv_col = kvh * HEAD_DIM + offs_d[None, :]
    if SLIDING:
        # The tile's first query (at prefix + m0) sees keys from prefix + m0 - window + 1 on, its
        # later queries from later ones: key tiles before that are skipped, never read.
        kv_start = tl.maximum(prefix + m0 - window + 1, 0)
    else:
        kv_start = 0
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        keep = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if SLIDING:
            keep = keep & (offs_n[None, :] > q_pos[:, None] - window)
        # Full attention: key 0 is visible to every row and sits in the first tile, so the running
        # maximum is finite from the first tile on. A window may leave a row no key in a tile
        # (EMPTY_ROWS); a real row still ends with at least itself.
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, bt_ptr + seq * stride_btb, offs_n, mask_n,
                                     keep, kv_col, mask_d, block_size, stride_k_slot, stride_v_slot, scale, softcap,
                                     IEEE, SOFTCAP, SLIDING)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start: torch.Tensor,
                            context_lens: torch.Tensor, block_size: int, scale: float,
                            max_query_len: int, *, sliding_window: int | None = None,
                            softcap: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of prefill chunks over the paged cache (the chunks' own K/V already
    written by rope_kv_write): query i of sequence s sits at position
    p = context_lens[s] - q_len_s + i and attends keys 0 .. p, or with a sliding window keys
    p - sliding_window + 1 .. p. Fresh prompts (context = chunk) and chunks continuing a cached
    prefix alike. Semantics: see the module docstring.

    Args:
        q: [Tp, Hq, D] rotated queries of the chunks, one contiguous run per sequence.
        k_cache, v_cache: [num_slots, Hkv, D].
        block_tables: [S, max_blocks] int32 (entries past a sequence's blocks are never read).
        query_start: [S + 1] int32, cumulative chunk lengths from 0 (query_start[S] = Tp).
        context_lens: [S] int32, cached tokens of each sequence after its chunk (chunk included;
            >= its chunk's length).
        max_query_len: a host-side bound of the chunks' lengths (sizes the grid; no device read).
        sliding_window: keys a query sees, itself included (HF's `sliding_window`); None: all.
        softcap: scores become softcap * tanh(scores / softcap) (HF's
            `attn_logit_softcapping`); None: unchanged.
        out: where to write the result ([Tp, Hq, D], as paged_decode_attention's); None: new.
    Returns:
        out: [Tp, Hq, D] in q's dtype.
    """
    Tp, Hq, D = _check_q(q, k_cache, "q")
    _check_cache(k_cache, v_cache, k_cache.shape[1], D)
    S = context_lens.shape[0] if context_lens.dim() == 1 else -1
    _check_tables(block_tables, S, context_lens, "context_lens")
    if query_start.shape != (S + 1,) or query_start.dtype != torch.int32:
        raise ValueError(f"query_start must be int32 [{S + 1}]")
    device = common_device(q, k_cache, v_cache, block_tables, query_start, context_lens, what=_KERNELS)
    variant = _variant_args(sliding_window, softcap, block_tables.shape[1] * block_size)
    out = _output(out, (Tp, Hq, D), q.dtype, device)
    if Tp == 0 or S == 0 or max_query_len <= 0:
        return out
    cfg = kernel_config(device, "prefill", D)
    block_m, block_n = cfg["block_m"], cfg["block_n"]
    check_blocks(minimum=16, block_m=block_m, block_n=block_n)
    Hkv = k_cache.shape[1]
    m_blocks = triton.cdiv(max_query_len, block_m)
    _prefill_kernel[(S * m_blocks, Hq)](
        q, k_cache, v_cache, block_tables, query_start, context_lens, out,
        scale, block_size, block_tables.shape[1], m_blocks,
        q.stride(0), q.stride(1), k_cache.stride(0), v_cache.stride(0), block_tables.stride(0),
        out.stride(0), out.stride(1), **variant,
        G=Hq // Hkv, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_D=max(16, next_pow2(D)), BLOCK_N=block_n,
        IEEE=dot_in_fp32(q.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
