"""The CPU path: the same four ops with torch matmuls, for CPU tensors.

Measured on this 2-core machine (bench/kernels.py, bench/RESULTS.md): gathering a weight copy
per token and running bmm (vLLM's CPU fallback shape) moves T x R x K bytes twice and runs T
tiny matmuls; a Python loop of one matmul per adapter pays ~10 us per adapter. What wins is
sorting tokens by slot (a copy of x's rows, small at decode) and one `torch._grouped_mm` over
the slot stack itself: no weight copy, one call, each adapter's rows times its own matrix.
Only when the per-token weight copies are small (GATHER_BMM_MAX_BYTES) is gather + bmm faster.
Mixed ranks: tokens are grouped by rank too, and each rank group uses the stack narrowed to
that rank, so the work per token is proportional to its adapter's rank.

For SGMV with long segments (prefill) the rows are already contiguous, so each segment is one
plain matmul on a view of x, with no gather at all.

fp16/bf16 on CPU: products run in the input dtype (CPU GEMMs accumulate in fp32 internally)
and are widened to the fp32 intermediate; the Triton path keeps every step in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_expand, check_segments, check_shrink, check_token_slots

# Segments at least this long on average go through one matmul per segment on views;
# shorter ones (decode-like) through the sorted grouped path.
SEGMENT_LOOP_MIN_AVG_LEN = 8

_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")

# Below this many bytes of per-token weight copies, gather + bmm beats grouped_mm (whose cost
# grows with the number of slots it spans): measured at 32 tokens x 32 adapters, rank 16, fp32
# on 2 cores, hidden 576 (1.2 MB gathered) favours gather+bmm, hidden 4096 (8.4 MB) grouped_mm.
GATHER_BMM_MAX_BYTES = 4 << 20


@dataclass(frozen=True)
class RankGroup:
    """Tokens whose adapters share one rank, sorted by slot."""

    rank: int
    tokens: torch.Tensor  # [n] int64 token indices, sorted by slot
    slots: torch.Tensor  # [n] int64 slot of each of those tokens
    slot_lo: int  # the group covers stack slots [slot_lo, slot_hi)
    slot_hi: int
    offs: torch.Tensor  # [slot_hi - slot_lo] int32: end row of each slot's tokens (grouped_mm offs)
    slot_list: tuple[int, ...]  # distinct slots, for the no-grouped_mm fallback
    count_list: tuple[int, ...]


def plan_tokens(token_slots: torch.Tensor, ranks: torch.Tensor) -> list[RankGroup]:
    """Group the tokens that have an adapter by (rank, slot); rank-0 adapters drop out."""
    slots = token_slots.to("cpu", torch.int64)
    rk_all = ranks.to("cpu", torch.int64)
    tok = (slots >= 0).nonzero().squeeze(1)
    if tok.numel() == 0:
        return []
    sl = slots[tok]
    rk = rk_all[sl]
    order = torch.argsort(rk * (rk_all.shape[0] + 1) + sl, stable=True)
    tok, sl, rk = tok[order], sl[order], rk[order]
    rank_vals, rank_counts = torch.unique_consecutive(rk, return_counts=True)
    groups, lo = [], 0
    for r, c in zip(rank_vals.tolist(), rank_counts.tolist()):
        hi = lo + c
        if r > 0:
            s = sl[lo:hi]
            s_lo, s_hi = int(s[0]), int(s[-1]) + 1
            counts = torch.bincount(s - s_lo, minlength=s_hi - s_lo)
            d, dc = torch.unique_consecutive(s, return_counts=True)
            groups.append(RankGroup(r, tok[lo:hi], s, s_lo, s_hi, torch.cumsum(counts, 0).to(torch.int32),
                                    tuple(d.tolist()), tuple(dc.tolist())))
        lo = hi
    return groups


def _aligned(t: torch.Tensor) -> bool:
    """torch._grouped_mm needs 16-byte aligned strides and base (e.g. not fp32 rows of width 129)."""
    size, strides = t.element_size(), sorted(t.stride())
    # one unit-stride (inner) dim; every other stride a multiple of 16 bytes
    return t.data_ptr() % 16 == 0 and strides[0] == 1 and all((st * size) % 16 == 0 for st in strides[1:])


def _group_matmul(rows: torch.Tensor, w_t: torch.Tensor, g: RankGroup) -> torch.Tensor:
    """rows [n, K] sorted by slot; w_t [slot_hi - slot_lo, K, N] -> [n, N], each row times its slot's matrix."""
    if w_t.shape[0] == 1:
        return rows @ w_t[0]
    if rows.shape[0] * w_t.shape[1] * w_t.shape[2] * w_t.element_size() <= GATHER_BMM_MAX_BYTES:
        per_token = w_t.index_select(0, g.slots - g.slot_lo)  # [n, K, N] copy, small by the test above
        return torch.bmm(rows.unsqueeze(1), per_token).squeeze(1)
    # its output rows [n, N] must be 16-byte aligned too
    if _HAS_GROUPED_MM and _aligned(rows) and _aligned(w_t) and (w_t.shape[2] * rows.element_size()) % 16 == 0:
        return torch._grouped_mm(rows, w_t, offs=g.offs)
    out = rows.new_empty(rows.shape[0], w_t.shape[2])
    i = 0
    for s, c in zip(g.slot_list, g.count_list):
        torch.mm(rows[i:i + c], w_t[s - g.slot_lo], out=out[i:i + c])
        i += c
    return out


def _shrink_grouped(args, scales, groups) -> None:
    v = args.out
    for g in groups:
        rows = args.x.index_select(0, g.tokens)
        scale = scales.index_select(0, g.slots).unsqueeze(1)
        for l, A in enumerate(args.slices):
            w_t = A[g.slot_lo:g.slot_hi, :g.rank, :].transpose(1, 2)
            res = _group_matmul(rows, w_t, g).float().mul_(scale)
            v[l, :, :g.rank].index_copy_(0, g.tokens, res)


def _expand_grouped(args, groups) -> None:
    y = args.y
    for g in groups:
        for l, B in enumerate(args.slices):
            rows = args.v[l, :, :g.rank].index_select(0, g.tokens).to(B.dtype)
            w_t = B[g.slot_lo:g.slot_hi, :, :g.rank].transpose(1, 2)
            res = _group_matmul(rows, w_t, g)
            y.narrow(1, args.offsets[l], args.widths[l]).index_add_(0, g.tokens, res)


def _plan(token_slots, ranks, meta):
    if meta is not None and meta.num_tokens == token_slots.shape[0]:
        return meta.cpu_plan(ranks)
    return plan_tokens(token_slots, ranks)


def bgmv_shrink(x, lora_a, token_slots, scales, ranks, *, meta=None, out=None):
    """CPU BGMV shrink; same contract as `punica_kernels.bgmv_shrink`."""
    args = check_shrink(x, lora_a, scales, ranks, out)
    check_token_slots(token_slots, args.num_tokens, args.num_slots, x.device)
    _shrink_grouped(args, scales, _plan(token_slots, ranks, meta))
    return args.out[0] if args.single else args.out


def bgmv_expand(v, lora_b, token_slots, ranks, y, *, offsets=None, meta=None):
    """CPU BGMV expand; same contract as `punica_kernels.bgmv_expand` (adds into y)."""
    args = check_expand(v, lora_b, ranks, y, offsets)
    check_token_slots(token_slots, args.num_tokens, args.num_slots, y.device)
    _expand_grouped(args, _plan(token_slots, ranks, meta))
    return y


def _segments(seg_starts, seg_slots):
    st = seg_starts.tolist()
    return [(a, b, s) for a, b, s in zip(st, st[1:], seg_slots.tolist()) if s >= 0 and b > a]


def _long_segments(segs, num_tokens) -> bool:
    return bool(segs) and num_tokens >= SEGMENT_LOOP_MIN_AVG_LEN * len(segs)


def _segment_token_slots(seg_starts, seg_slots, num_tokens):
    lens = (seg_starts[1:] - seg_starts[:-1]).to(torch.int64)
    return torch.repeat_interleave(seg_slots.to(torch.int64), lens, output_size=num_tokens)


def sgmv_shrink(x, lora_a, seg_starts, seg_slots, scales, ranks, *, max_segment_len=None, meta=None, out=None):
    """CPU SGMV shrink; same contract as `punica_kernels.sgmv_shrink` (max_segment_len unused)."""
    args = check_shrink(x, lora_a, scales, ranks, out)
    check_segments(seg_starts, seg_slots, args.num_tokens, args.num_slots, x.device)
    segs = _segments(seg_starts, seg_slots)
    if not _long_segments(segs, args.num_tokens):
        slots = _segment_token_slots(seg_starts, seg_slots, args.num_tokens)
        _shrink_grouped(args, scales, _plan(slots, ranks, meta))
    else:
        rank_list, scale_list = ranks.tolist(), scales.tolist()
        for a, b, s in segs:
            r = rank_list[s]
            if r == 0:
                continue
            for l, A in enumerate(args.slices):
                prod = args.x[a:b] @ A[s, :r].t()
                args.out[l, a:b, :r] = prod.float().mul_(scale_list[s])
    return args.out[0] if args.single else args.out


def sgmv_expand(v, lora_b, seg_starts, seg_slots, ranks, y, *, offsets=None, max_segment_len=None, meta=None):
    """CPU SGMV expand; same contract as `punica_kernels.sgmv_expand` (adds into y)."""
    args = check_expand(v, lora_b, ranks, y, offsets)
    check_segments(seg_starts, seg_slots, args.num_tokens, args.num_slots, y.device)
    segs = _segments(seg_starts, seg_slots)
    if not _long_segments(segs, args.num_tokens):
        slots = _segment_token_slots(seg_starts, seg_slots, args.num_tokens)
        _expand_grouped(args, _plan(slots, ranks, meta))
        return y
    rank_list = ranks.tolist()
    for a, b, s in segs:
        r = rank_list[s]
        if r == 0:
            continue
        for l, B in enumerate(args.slices):
            y_blk = y[a:b, args.offsets[l]:args.offsets[l] + args.widths[l]]
            y_blk.addmm_(args.v[l, a:b, :r].to(B.dtype), B[s, :, :r].t())
    return y
