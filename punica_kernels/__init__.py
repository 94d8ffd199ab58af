"""SGMV/BGMV batched-LoRA kernels: many adapters in one batch, one function per op.

Contract (what the engine calls):

Weights are stacked per adapter slot and zero-padded to the stack's max rank R:
    lora_a: [S, R, K]   (shrink: x [T, K] -> v [T, R])
    lora_b: [S, N, R]   (expand: v [T, R] -> added into y[:, off:off+N])
    ranks:  [S] int32/int64, the true rank of each slot; only the first ranks[s] rows of A[s]
            and columns of B[s] are read, so the work per token is proportional to its rank.
    scales: [S] float32, alpha / r (or the rsLoRA scale), applied in shrink.
Slot -1 means "no adapter": shrink writes zeros, expand leaves y untouched.
Several slices in one call (q, k, v; gate, up): pass a sequence of stacks (all sharing S and R;
expand stacks may differ in N) and, for expand, the first output column of each slice
(`offsets`, default: packed side by side from column 0). With a sequence, shrink returns the
fp32 intermediate v as [L, T, R] and expand takes it as such; with a single tensor, v is [T, R].

    v = bgmv_shrink(x, lora_a, token_slots, scales, ranks, *, meta=None, out=None, impl=None)
    bgmv_expand(v, lora_b, token_slots, ranks, y, *, offsets=None, meta=None, impl=None) -> y
    v = sgmv_shrink(x, lora_a, seg_starts, seg_slots, scales, ranks, *, max_segment_len=None, meta=None, out=None, impl=None)
    sgmv_expand(v, lora_b, seg_starts, seg_slots, ranks, y, *, offsets=None, max_segment_len=None, meta=None, impl=None) -> y
    add_lora(y, x, lora_a, lora_b, scales, ranks, *, meta, offsets=None, impl=None) -> y   (shrink + expand)
    stack = lora_stack(lora_a, lora_b, scales, ranks, offsets=None); add_lora(y, x, stack, meta=meta)
    meta = build_lora_metadata(slot_per_token, *, num_slots=None, device=None, num_decode=None)
    groups = group_decode_tokens(token_slots, num_slots)   (device-side grouping by slot, see below)

BGMV (decode) takes a slot per token; SGMV (prefill) takes segments: `seg_starts` [n+1]
(0 ... T, empty segments allowed) and `seg_slots` [n]. `build_lora_metadata` produces both from
one slot list without permuting tokens. x, weights and y: fp16, bf16 or fp32 (x matches
lora_a, y matches lora_b), contiguous, one device; v is always fp32. y is updated in place.
Mixed forms, `add_lora` on CPU only, with fp32 x and y: bf16 stacks (adapters stored at half
the bytes; the C kernel widens them in registers) and int8 stacks with fp32 row scales
(`lora_stack(..., a_row_scales=, b_row_scales=)`, made by `quantize_rows`; a quarter of the bytes).
In int8 stacks a slot's B takes the first N * rank bytes of its [N, R] block, in rank pairs
(`int8_b_write`, `pack_int8_b`), so a rank-16 adapter in a rank-64 stack reads a quarter of the
bytes [N, R] rows would pull in.

Dispatch (`impl`): None (the default) picks by device: CUDA tensors run the Triton kernels
(punica_kernels.kernels), CPU tensors the torch/C path (punica_kernels.cpu). impl="triton" runs
the Triton kernels whatever the device: on CPU tensors through the Triton interpreter, which
needs TRITON_INTERPRET=1 set before the kernels are imported (Triton builds each kernel for the
interpreter or the GPU at import, so one process runs one of the two; a mismatch raises
RuntimeError saying so). impl="cpu" runs the CPU path and takes CPU tensors only. `meta` is
optional for the four ops: the CPU path reuses its token grouping across the many layers of one
step. `punica_kernels.reference` is a slow float64 reference for tests.

Mixed batches (`build_lora_metadata(..., num_decode=d)`): tokens [0, d) are decode tokens, one
per sequence, the rest prefill chunks. The Triton add_lora then runs the grouped shrink + expand
over rows [0, d) and SGMV shrink + expand over the prefill rows' runs of equal slots (views of x
and y), each skipped when empty; d = 0 is an all-prefill batch (SGMV only). num_decode=None (not
given) runs the grouped kernels over every token. Every launch size is a host int from the
metadata or the shapes, so the Triton path never reads a device value back.
The CPU path ignores num_decode (it groups tokens by slot whatever their kind).

Grouped decode (the Triton add_lora's decode rows): `group_decode_tokens(slots, S)` sorts the
rows stably by slot on the device (`DecodeGroups`: an order and each slot's bounds, shapes fixed
by T and S, so a captured graph recomputes it from its static slot buffer); the grouped shrink
and expand (punica_kernels.kernels.grouped_*) then run one program per (slot, tile) over that
slot's rows with tl.dot, reading each adapter's weights once however many rows share it. A
caller making many calls per step (the engine's batch) groups once and sets
`meta.decode_groups`; otherwise add_lora groups per call. BGMV (one program per token) stays as
the per-token ops above. Every shrink on this path writes all of its fp32 intermediate (zeros
included) and the grouped shrink's split-K is summed in a fixed order by the last program of a
tile: no zero-fill launch, and repeated calls are bit-identical.

Bad calls raise TypeError (dtype) or ValueError (shape, device, contiguity, slot or rank value).
Checks that read tensor values run for CPU tensors only; on CUDA they would sync the device and
break graph capture, so slots are checked on the host by `build_lora_metadata(num_slots=S)`.
"""

from __future__ import annotations

import torch

from . import cpu, reference
from ._checks import LoRAStack, check_add_lora, lora_stack
from .metadata import DecodeGroups, LoRAMetadata, build_lora_metadata, group_decode_tokens
from .quantize import int8_b_read, int8_b_write, pack_int8_b, quantize_rows, unpack_int8_b

__all__ = [
    "bgmv_shrink", "bgmv_expand", "sgmv_shrink", "sgmv_expand", "add_lora",
    "build_lora_metadata", "LoRAMetadata", "DecodeGroups", "group_decode_tokens", "LoRAStack", "lora_stack",
    "quantize_rows", "int8_b_write", "int8_b_read", "pack_int8_b", "unpack_int8_b",
    "reference",
]


IMPLS = (None, "triton", "cpu")


def _use_triton(t, impl: str | None = None) -> bool:
    """Which path a call on tensor `t` takes: impl None by device (CUDA: Triton, CPU: the CPU
    path), "triton" always (CPU tensors then need the interpreter: kernels._common.check_runnable
    raises RuntimeError otherwise), "cpu" for CPU tensors only."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in ("cuda", "cpu"):
        raise ValueError(f"punica_kernels runs on CUDA or CPU tensors, not {t.device.type}")
    if impl is None:
        return t.device.type == "cuda"
    if impl == "triton":
        return True
    if impl == "cpu":
        if t.device.type != "cpu":
            raise ValueError(f"impl='cpu' runs on CPU tensors; these are on {t.device}")
        return False
    raise ValueError(f"impl must be None, 'triton' or 'cpu'; got {impl!r}")


def bgmv_shrink(x, lora_a, token_slots, scales, ranks, *, meta: LoRAMetadata | None = None, out=None,
                impl: str | None = None):
    """Decode shrink: v[t] = scales[s] * x[t] @ A[s, :ranks[s]].T with s = token_slots[t] (0 if s == -1).

    Returns fp32 v: [T, R] for one stack, [L, T, R] for a sequence of L stacks.
    """
    if _use_triton(x, impl):
        from .kernels import bgmv_shrink_triton

        return bgmv_shrink_triton(x, lora_a, token_slots, scales, ranks, out=out)
    return cpu.bgmv_shrink(x, lora_a, token_slots, scales, ranks, meta=meta, out=out)


def bgmv_expand(v, lora_b, token_slots, ranks, y, *, offsets=None, meta: LoRAMetadata | None = None,
                impl: str | None = None):
    """Decode expand: y[t, off:off+N] += v[t, :r] @ B[s, :, :r].T with s = token_slots[t], r = ranks[s].

    Skips tokens with slot -1. Updates y in place and returns it.
    """
    if _use_triton(y, impl):
        from .kernels import bgmv_expand_triton

        return bgmv_expand_triton(v, lora_b, token_slots, ranks, y, offsets=offsets)
    return cpu.bgmv_expand(v, lora_b, token_slots, ranks, y, offsets=offsets, meta=meta)


def sgmv_shrink(x, lora_a, seg_starts, seg_slots, scales, ranks, *, max_segment_len=None,
                meta: LoRAMetadata | None = None, out=None, impl: str | None = None):
    """Prefill shrink: as bgmv_shrink, with one slot per segment [seg_starts[i], seg_starts[i+1]).

    max_segment_len (host int, e.g. meta.max_segment_len) bounds the Triton grid; None means T.
    """
    if _use_triton(x, impl):
        from .kernels import sgmv_shrink_triton

        return sgmv_shrink_triton(x, lora_a, seg_starts, seg_slots, scales, ranks,
                                  max_segment_len=max_segment_len, out=out)
    return cpu.sgmv_shrink(x, lora_a, seg_starts, seg_slots, scales, ranks, meta=meta, out=out)


def sgmv_expand(v, lora_b, seg_starts, seg_slots, ranks, y, *, offsets=None, max_segment_len=None,
                meta: LoRAMetadata | None = None, impl: str | None = None):
    """Prefill expand: as bgmv_expand, with one slot per segment. Updates y in place and returns it."""
    if _use_triton(y, impl):
        from .kernels import sgmv_expand_triton

        return sgmv_expand_triton(v, lora_b, seg_starts, seg_slots, ranks, y, offsets=offsets,
                                  max_segment_len=max_segment_len)
    return cpu.sgmv_expand(v, lora_b, seg_starts, seg_slots, ranks, y, offsets=offsets, meta=meta)


def add_lora(y, x, lora_a, lora_b=None, scales=None, ranks=None, *, meta: LoRAMetadata, offsets=None,
             impl: str | None = None):
    """The whole adapter term of one layer: for every token t with slot s = meta.token_slots[t]
    (s != -1) and every slice l, y[t, off_l:off_l+N_l] += scales[s] * x[t] @ A_l[s, :r].T @ B_l[s, :, :r].T
    with r = ranks[s]; same as bgmv_shrink then bgmv_expand. `lora_a` / `lora_b`: one stack each,
    or matching sequences of slices. Updates y in place and returns it.

    `lora_a` may instead be a `LoRAStack` (`lora_stack(lora_a, lora_b, scales, ranks, offsets)`,
    checked once), with lora_b, scales, ranks and offsets left out: a caller making the same call
    every step (the engine) then pays only the activations' and rank values' checks.

    impl: None picks by device (CUDA: Triton, CPU: the CPU path); "triton" or "cpu" forces one
    (see `_use_triton`). Triton: with meta.num_decode = d given, the grouped shrink + expand over
    rows [0, d) (grouped by meta.decode_groups, else by `group_decode_tokens` here) and SGMV
    shrink + expand over the rest's segments (views of x and y; each part skipped when empty);
    with meta.num_decode None, the grouped kernels over every token. Each part is two launches
    with an fp32 intermediate (allocated, never filled), and nothing reads a device value back.
    Weights must match the activations' dtypes; int8 stacks are CPU-only (TypeError). CPU: one
    fused pass over the step's cached slot-major plan (punica_kernels.cpu.add_lora), the engine's
    decode path there; it ignores num_decode.
    """
    if not _use_triton(x, impl):
        return cpu.add_lora(y, x, lora_a, lora_b, scales, ranks, meta=meta, offsets=offsets)
    from .kernels import grouped_expand_triton, grouped_shrink_triton, sgmv_expand_triton
    from .kernels._common import check_runnable
    from .kernels.sgmv_shrink import sgmv_shrink_into

    check_runnable(x.device)
    if isinstance(lora_a, LoRAStack) and lora_a.quantized:
        raise TypeError("int8 LoRA stacks are a CPU form (impl='cpu'); Triton stacks are fp16, bf16 or fp32")
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"y must be a torch.Tensor, got {type(y).__name__}")
    if x.dim() != 2 or y.dim() != 2 or not x.shape[0] == y.shape[0] == meta.num_tokens:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must be 2-D with one row per token "
                         f"of the metadata ({meta.num_tokens})")
    st = check_add_lora(y, x, lora_a, lora_b, scales, ranks, offsets).stack
    if any(a.dtype != x.dtype or b.dtype != y.dtype for a, b in zip(st.a_slices, st.b_slices)):
        raise TypeError(f"on Triton, lora_a must match x's dtype ({x.dtype}) and lora_b y's ({y.dtype})")
    L, R, T = len(st.a_slices), st.max_rank, meta.num_tokens
    nd = T if meta.num_decode is None else meta.num_decode
    # v is written entirely by each shrink (never accumulated into), so it needs no fill.
    if nd > 0:
        groups = meta.decode_groups
        if groups is None:
            groups = group_decode_tokens(meta.token_slots[:nd], st.num_slots)
        v = torch.empty(L, nd, R, dtype=torch.float32, device=x.device)
        grouped_shrink_triton(x[:nd], st.a_slices, groups, st.scales, st.ranks, v)
        grouped_expand_triton(v, st.b_slices, groups, st.ranks, y[:nd], offsets=st.offsets)
    if nd < T:
        starts, slots, max_len = meta.prefill_seg_starts, meta.prefill_seg_slots, meta.prefill_max_segment_len
        v = torch.empty(L, T - nd, R, dtype=torch.float32, device=x.device)
        sgmv_shrink_into(x[nd:], st.a_slices, starts, slots, st.scales, st.ranks, v, max_segment_len=max_len)
        sgmv_expand_triton(v, st.b_slices, starts, slots, st.ranks, y[nd:], offsets=st.offsets,
                           max_segment_len=max_len)
    return y
