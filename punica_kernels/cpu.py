"""The CPU path: the same four ops with torch matmuls, for CPU tensors.

What a 2-core CPU rewards is reading each adapter's weights once per call, in a few large
calls. The decode shape (many tokens, each on its own adapter) is laid out slot-major: the
tokens of each slot are gathered into a zero-padded block [n_slots, m, K] (m = most tokens on
one slot; a copy of activation rows, small), and one `torch.bmm` multiplies every slot's block
by that slot's own matrix, read in place from the stack (a view: no weight copy). Each adapter's
weights are then read once per call, where gather + bmm (vLLM's CPU fallback shape) copies a
weight per token and dense GEMMs over all slots multiply every token by every adapter
(bench/RESULTS.md and bench/kernels.py compare the three). A slot with far more tokens than the others (a long prompt among decode tokens) gets
its own matmul instead of padding every other slot to its size (BLOCK_PAD_FACTOR), on a view of
x when its tokens are one contiguous run.

Mixed ranks: tokens are grouped by rank, and each group uses the stacks narrowed to that rank,
so the work per token is proportional to its adapter's rank. A group whose slots are spread
thinly over the stack gathers just those slots' weights (once per adapter, not per token).

For SGMV with long segments (prefill) the rows are already contiguous, so each segment is one
plain matmul on a view of x, with no gather at all.

fp16/bf16 on CPU: products run in the input dtype (CPU GEMMs accumulate in fp32 internally)
and are widened to the fp32 intermediate; the Triton path keeps every step in fp32. `add_lora`
also takes bf16 and int8 stacks with fp32 activations on CPU (the engine's storage where the C
kernel is built): the kernel widens the weights in registers; here they are widened (and int8
ones scaled) per call.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from . import cpu_native
from ._checks import check_add_lora, check_expand, check_segments, check_shrink, check_token_slots
from .quantize import int8_b_read

# Segments at least this long on average go through one matmul per segment on views;
# shorter ones (decode-like) through the slot-major plan.
SEGMENT_LOOP_MIN_AVG_LEN = 8

# The slot-major block pads every slot to the busiest slot's token count. Slots are taken out of
# the block (each gets its own matmul) from the busiest down while the padded rows exceed
# BLOCK_PAD_FACTOR x the real ones; MIN_BLOCK_ROWS of padding is always fine. A prefill step of
# many similar-length prompts stays one block (2 bmm per module instead of 2 matmuls per prompt);
# one long prompt among decode tokens gets its own matmul.
BLOCK_PAD_FACTOR = 4
MIN_BLOCK_ROWS = 64
# A block whose slots span at most HOLE_FACTOR x their number reads that stack range in place
# (unused slots in it are padding); sparser ones gather just their slots' weights.
HOLE_FACTOR = 3


@dataclass(frozen=True)
class BigSlot:
    """One slot with many tokens: a plain matmul over its rows."""

    slot: int
    tokens: torch.Tensor  # [c] int64 token indices, ascending
    run: tuple[int, int] | None  # (start, end) when the tokens are one contiguous run: views, no gather


@dataclass(frozen=True)
class RankGroup:
    """The tokens whose adapters share one rank: a slot-major padded block plus big slots."""

    rank: int
    block_slots: slice | torch.Tensor | None  # stack slots of the block: a range, or an index (gathered); None = no block
    m: int  # padded rows per slot in the block
    rows: torch.Tensor  # [n*m] token of each padded row (padding repeats a real token; masked or dropped)
    pad_mask: torch.Tensor | None  # [n, m, 1] 1.0 for real rows, 0.0 for padding; None without padding
    tokens: torch.Tensor  # [n_tok] the block's tokens
    token_rows: torch.Tensor  # [n_tok] padded row of each of those tokens
    big: tuple[BigSlot, ...]
    run: tuple[int, int] | None = None  # rows are exactly tokens [a, b) in order (no padding): views, no gather/scatter


def _split_big(counts: list[int]) -> list[bool]:
    """Which slots get their own matmul: take the slot with the most tokens out of the block while
    the block's padded rows exceed BLOCK_PAD_FACTOR x its real tokens (and MIN_BLOCK_ROWS)."""
    order = sorted(range(len(counts)), key=lambda i: -counts[i])
    big = [False] * len(counts)
    rest, n = sum(counts), len(counts)
    for i in order:
        m = counts[i]  # the largest count left sets the block's height
        if n * m <= max(BLOCK_PAD_FACTOR * rest, MIN_BLOCK_ROWS):
            break
        big[i] = True
        rest -= m
        n -= 1
    return big


def _plan_rank_group(rank: int, tok: torch.Tensor, sl: torch.Tensor, slot_ranks: list[int]) -> RankGroup:
    """tok/sl: tokens of one rank and their slots, sorted by (slot, token); slot_ranks: every
    slot's rank (a slot inside the block's range that no token uses is read up to `rank` only
    if its own rank reaches that far: the contract never reads past a slot's rank)."""
    d, counts = torch.unique_consecutive(sl, return_counts=True)
    d_list, c_list = d.tolist(), counts.tolist()
    big_flags = _split_big(c_list)
    big, start = [], 0
    for s, c, is_big in zip(d_list, c_list, big_flags):
        if is_big:
            t = tok[start:start + c]
            a, b = int(t[0]), int(t[-1]) + 1
            big.append(BigSlot(s, t, (a, b) if b - a == c else None))
        start += c
    small = torch.tensor([not f for f in big_flags])
    if not bool(small.any()):
        empty = torch.zeros(0, dtype=torch.int64)
        return RankGroup(rank, None, 0, empty, None, empty, empty, tuple(big))
    keep = torch.repeat_interleave(small, counts)
    tok_s = tok[keep]
    d_s, c_s = d[small], counts[small]
    m = int(c_s.max())
    lo, hi = int(d_s[0]), int(d_s[-1]) + 1
    used = set(d_s.tolist())
    holes_readable = all(slot_ranks[h] >= rank for h in range(lo, hi) if h not in used)
    if hi - lo <= HOLE_FACTOR * d_s.numel() and holes_readable:
        # Read the stack's range [lo, hi) in place; slots in it that no token uses are all padding.
        block_slots: slice | torch.Tensor = slice(lo, hi)
        n, block_of_slot = hi - lo, d_s - lo
    else:  # few slots spread wide: gather just those slots' weights
        block_slots = d_s
        n, block_of_slot = d_s.numel(), torch.arange(d_s.numel())
    # Row of each token in the padded block: its slot's block index * m + its rank within the slot.
    first = torch.cumsum(c_s, 0) - c_s
    within = torch.arange(tok_s.numel()) - torch.repeat_interleave(first, c_s)
    token_rows = torch.repeat_interleave(block_of_slot, c_s) * m + within
    rows = torch.full((n * m,), int(tok_s[0]), dtype=torch.int64)  # padding repeats a real token
    rows[token_rows] = tok_s
    pad_mask = None
    run = None
    if n * m != tok_s.numel():
        pad_mask = torch.zeros(n * m, 1)
        pad_mask[token_rows] = 1.0
        pad_mask = pad_mask.view(n, m, 1)
    else:
        # The engine orders a step's decode tokens by slot, so the block's rows are usually one
        # run of the batch: x and y are then read and written through views.
        a = int(rows[0])
        if torch.equal(rows, torch.arange(a, a + rows.numel())):
            run = (a, a + rows.numel())
    return RankGroup(rank, block_slots, m, rows, pad_mask, tok_s, token_rows, tuple(big), run)


def plan_tokens(token_slots: torch.Tensor, ranks: torch.Tensor) -> list[RankGroup]:
    """Group the tokens that have an adapter by rank, then lay each group out slot-major;
    rank-0 adapters drop out."""
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
    slot_ranks = rk_all.tolist()
    groups, lo = [], 0
    for r, c in zip(rank_vals.tolist(), rank_counts.tolist()):
        if r > 0:
            groups.append(_plan_rank_group(r, tok[lo:lo + c], sl[lo:lo + c], slot_ranks))
        lo += c
    return groups


def _block_weights(w: torch.Tensor, g: RankGroup) -> torch.Tensor:
    """The block's slots of stack w (already narrowed to the rank): a view, or a gather of
    just those slots when they are not one range."""
    if isinstance(g.block_slots, slice):
        return w[g.block_slots]
    return w.index_select(0, g.block_slots)


def _shrink_grouped(args, scales, groups) -> None:
    v, x = args.out, args.x
    for g in groups:
        r = g.rank
        if g.block_slots is not None:
            n = g.rows.numel() // g.m
            xb = x.index_select(0, g.rows).view(n, g.m, -1)
            scale = _block_weights(scales, g).view(n, 1, 1)
            for l, A in enumerate(args.slices):
                vb = torch.bmm(xb, _block_weights(A[:, :r, :], g).transpose(1, 2)).float().mul_(scale)
                vb = vb.view(n * g.m, r)
                if g.pad_mask is None:  # every padded row is a distinct token: copy rows straight in
                    v[l, :, :r].index_copy_(0, g.rows, vb)
                else:
                    v[l, :, :r].index_copy_(0, g.tokens, vb.index_select(0, g.token_rows))
        for b in g.big:
            rows = x[b.run[0]:b.run[1]] if b.run else x.index_select(0, b.tokens)
            for l, A in enumerate(args.slices):
                res = (rows @ A[b.slot, :r].t()).float().mul_(scales[b.slot])
                if b.run:
                    v[l, b.run[0]:b.run[1], :r] = res
                else:
                    v[l, :, :r].index_copy_(0, b.tokens, res)


def _expand_grouped(args, groups) -> None:
    y = args.y
    packed = len(args.slices) > 1 and args.packed
    for g in groups:
        r = g.rank
        if g.block_slots is not None:
            n = g.rows.numel() // g.m
            outs = []
            for l, B in enumerate(args.slices):
                vb = args.v[l, :, :r].index_select(0, g.rows).view(n, g.m, r)
                if g.pad_mask is not None:
                    vb.mul_(g.pad_mask)  # padding rows add exactly zero to the token they repeat
                out = torch.bmm(vb.to(B.dtype), _block_weights(B[:, :, :r], g).transpose(1, 2))
                if packed:
                    outs.append(out)
                else:
                    y.narrow(1, args.offsets[l], args.widths[l]).index_add_(0, g.rows, out.view(n * g.m, -1))
            if packed:
                # One scatter into whole rows of y, not one per narrow (strided) column slice.
                y.narrow(1, 0, sum(args.widths)).index_add_(0, g.rows, torch.cat(outs, 2).view(n * g.m, -1))
        for b in g.big:
            for l, B in enumerate(args.slices):
                y_l = y.narrow(1, args.offsets[l], args.widths[l])
                v_l = args.v[l, :, :r]
                w_t = B[b.slot, :, :r].t()
                if b.run:
                    y_l[b.run[0]:b.run[1]].addmm_(v_l[b.run[0]:b.run[1]].to(B.dtype), w_t)
                else:
                    y_l.index_add_(0, b.tokens, v_l.index_select(0, b.tokens).to(B.dtype) @ w_t)


#: Per LoRAMetadata: its token plans by rank values (`plan_for`), dropped with the metadata.
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plan_for(meta, ranks: torch.Tensor) -> list[RankGroup]:
    """The token grouping of `meta`'s slots for `ranks`, cached per metadata object and rank
    values: every layer of a step shares one."""
    plans = _PLANS.get(meta)
    if plans is None:
        plans = _PLANS[meta] = {}
    key = tuple(ranks.tolist())
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = plan_tokens(meta.token_slots, ranks)
    return plan


def _plan(token_slots, ranks, meta):
    if meta is not None and meta.num_tokens == token_slots.shape[0]:
        return plan_for(meta, ranks)
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


def _segment_route(args, seg_starts, seg_slots, ranks, meta, device):
    """Check the segments, then pick the path: (segments, None) when they are long enough for
    one matmul each, else (None, the grouped plan of their tokens, each token given its
    segment's slot)."""
    check_segments(seg_starts, seg_slots, args.num_tokens, args.num_slots, device)
    segs = _segments(seg_starts, seg_slots)
    if _long_segments(segs, args.num_tokens):
        return segs, None
    lens = (seg_starts[1:] - seg_starts[:-1]).to(torch.int64)
    slots = torch.repeat_interleave(seg_slots.to(torch.int64), lens, output_size=args.num_tokens)
    return None, _plan(slots, ranks, meta)


def sgmv_shrink(x, lora_a, seg_starts, seg_slots, scales, ranks, *, max_segment_len=None, meta=None, out=None):
    """CPU SGMV shrink; same contract as `punica_kernels.sgmv_shrink` (max_segment_len unused)."""
    args = check_shrink(x, lora_a, scales, ranks, out)
    segs, plan = _segment_route(args, seg_starts, seg_slots, ranks, meta, x.device)
    if plan is not None:
        _shrink_grouped(args, scales, plan)
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
    segs, plan = _segment_route(args, seg_starts, seg_slots, ranks, meta, y.device)
    if plan is not None:
        _expand_grouped(args, plan)
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


def add_lora(y, x, lora_a, lora_b=None, scales=None, ranks=None, *, meta, offsets=None):
    """CPU fused shrink + expand; same contract as `punica_kernels.add_lora`.

    The intermediate stays in the plan's own layout (slot-major blocks, per-slot rows) between the
    two products instead of going to token order and back, and the scale is applied once: about
    half the ops of bgmv_shrink + bgmv_expand, which is what a decode step on a CPU pays for.
    """
    args = check_add_lora(y, x, lora_a, lora_b, scales, ranks, offsets)
    num_slots = args.stack.num_slots
    if meta.num_slots != num_slots:  # build_lora_metadata(num_slots=S) already checked the values
        check_token_slots(meta.token_slots, x.shape[0], num_slots, x.device)
    elif meta.num_tokens != x.shape[0]:
        raise ValueError(f"meta has {meta.num_tokens} tokens but x has {x.shape[0]}")
    if cpu_native.add_lora_f32(args, meta):  # decode-shaped fp32 calls: the C kernel
        return y
    scales, ranks = args.stack.scales, args.stack.ranks
    pairs = list(zip(args.a_slices, args.b_slices))
    if args.stack.quantized:
        # int8 stacks and no C kernel: dequantize whole stacks here, B from each slot's block at
        # its rank (correct, but copies per call; the engine stores int8 stacks only where the
        # kernel is built).
        rank_list = ranks.tolist()
        deq = []
        for (A, B), ars, brs in zip(pairs, args.stack.a_row_scales, args.stack.b_row_scales):
            Bf = torch.zeros(B.shape, dtype=y.dtype)
            for s, r in enumerate(rank_list):
                Bf[s, :, :r] = int8_b_read(B, s, r).to(y.dtype) * brs[s].unsqueeze(-1)
            deq.append((A.to(x.dtype) * ars.unsqueeze(-1), Bf))
        pairs = deq
    elif args.a_slices[0].dtype != x.dtype:
        # bf16 stacks with fp32 activations, and no C kernel to widen them in registers: widen
        # whole stacks here (correct, but a copy per call; the engine stores bf16 stacks only
        # where the kernel is built).
        pairs = [(A.to(x.dtype), B.to(y.dtype)) for A, B in pairs]
    scale_list = None
    for g in _plan(meta.token_slots, ranks, meta):
        r = g.rank
        if g.block_slots is not None:
            n = g.rows.numel() // g.m
            if g.run is not None:
                xb = x[g.run[0]:g.run[1]].view(n, g.m, -1)
            else:
                xb = x.index_select(0, g.rows).view(n, g.m, -1)
            sc = _block_weights(scales, g).view(n, 1, 1)
            if g.pad_mask is not None:
                sc = sc * g.pad_mask  # padding rows become exactly zero before the expand
            outs = []
            for A, B in pairs:
                vb = torch.bmm(xb, _block_weights(A[:, :r, :], g).transpose(1, 2)).float().mul_(sc)
                outs.append(torch.bmm(vb.to(B.dtype), _block_weights(B[:, :, :r], g).transpose(1, 2)))
            if g.run is not None:  # add each slice into its columns of the run's rows, in place
                y_run = y[g.run[0]:g.run[1]]
                for o, w, out in zip(args.offsets, args.widths, outs):
                    y_run.narrow(1, o, w).add_(out.view(n * g.m, w))
            elif args.packed:
                out = outs[0] if len(outs) == 1 else torch.cat(outs, 2)
                y.narrow(1, 0, sum(args.widths)).index_add_(0, g.rows, out.view(n * g.m, -1))
            else:
                for o, w, out in zip(args.offsets, args.widths, outs):
                    y.narrow(1, o, w).index_add_(0, g.rows, out.view(n * g.m, -1))
        if g.big and scale_list is None:
            scale_list = scales.tolist()
        for b in g.big:
            rows = x[b.run[0]:b.run[1]] if b.run else x.index_select(0, b.tokens)
            sc = scale_list[b.slot]
            for (A, B), o, w in zip(pairs, args.offsets, args.widths):
                v = (rows @ A[b.slot, :r].t()).float().to(B.dtype)
                y_l = y.narrow(1, o, w)
                if b.run:
                    y_l[b.run[0]:b.run[1]].addmm_(v, B[b.slot, :, :r].t(), alpha=sc)
                else:
                    y_l.index_add_(0, b.tokens, v @ B[b.slot, :, :r].t(), alpha=sc)
    return y
