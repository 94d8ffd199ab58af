"""Argument checks shared by the Triton launchers, the CPU path and the dispatcher.

Every op validates its arguments here first, so a bad call raises one clear `TypeError`
(wrong dtype) or `ValueError` (wrong shape, device, contiguity, slot or rank value) before
any kernel runs. Value checks (slot range, ranks <= R, segment bounds) read the tensors, so
they run only for CPU tensors: on CUDA they would force a device sync and break CUDA-graph
capture; there `build_lora_metadata` checks slots on the host instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
#: What a `LoRAStack`'s weights may be: a float type, or int8 with per-row scales (CPU add_lora).
STACK_DTYPES = (*FLOAT_DTYPES, torch.int8)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_tensor(t, name: str, *, ndim: int, dtypes, device: torch.device | None = None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(_dtype_name(d) for d in dtypes)
        raise TypeError(f"{name} has dtype {_dtype_name(t.dtype)}; expected one of: {allowed}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()); got strides {t.stride()}")


def _as_slices(w, name: str) -> tuple[list[torch.Tensor], bool]:
    """A weight stack or a sequence of them -> (list of stacks, whether a single tensor was given)."""
    if isinstance(w, torch.Tensor):
        return [w], True
    if isinstance(w, Sequence) and len(w) > 0 and all(isinstance(t, torch.Tensor) for t in w):
        return list(w), False
    raise TypeError(f"{name} must be a tensor or a non-empty sequence of tensors")


def _check_slot_values(slots: torch.Tensor, num_slots: int, name: str) -> None:
    if slots.device.type != "cpu" or slots.numel() == 0:
        return
    vals = slots.tolist()  # one host copy: cheaper than two reductions for a batch's slot list
    lo, hi = min(vals), max(vals)
    if lo < -1 or hi >= num_slots:
        bad = lo if lo < -1 else hi
        raise ValueError(
            f"{name} holds slot {bad}, outside [-1, {num_slots}) for a stack of {num_slots} slots "
            "(-1 means no adapter)"
        )


def _check_rank_values(ranks, max_rank: int) -> None:
    if ranks.device.type == "cpu" and ranks.numel() > 0:
        vals = ranks.tolist()
        lo, hi = min(vals), max(vals)
        if lo < 0 or hi > max_rank:
            raise ValueError(f"ranks must lie in [0, {max_rank}] (the stack's padded rank R); got {lo}..{hi}")


def _check_ranks_scales(ranks, scales, num_slots: int, max_rank: int, device) -> None:
    _check_tensor(ranks, "ranks", ndim=1, dtypes=INDEX_DTYPES, device=device)
    if ranks.shape[0] != num_slots:
        raise ValueError(f"ranks has {ranks.shape[0]} entries but the stack has {num_slots} slots")
    _check_rank_values(ranks, max_rank)
    if scales is not None:
        _check_tensor(scales, "scales", ndim=1, dtypes=(torch.float32,), device=device)
        if scales.shape[0] != num_slots:
            raise ValueError(f"scales has {scales.shape[0]} entries but the stack has {num_slots} slots")


def _checked_slices(slices: list[torch.Tensor], single: bool, what: str, ref: torch.Tensor, ref_name: str):
    """Yield (name, slice) for each weight slice once it is a 3-D contiguous float tensor with
    `ref`'s dtype and device; the caller checks its shape."""
    for i, w in enumerate(slices):
        name = what if single else f"{what}[{i}]"
        _check_tensor(w, name, ndim=3, dtypes=FLOAT_DTYPES, device=ref.device)
        if w.dtype != ref.dtype:
            raise TypeError(f"{name} has dtype {_dtype_name(w.dtype)} but {ref_name} has {_dtype_name(ref.dtype)}; they must match")
        yield name, w


@dataclass(frozen=True)
class ShrinkArgs:
    """Validated shrink call: x [T, K], slices of [S, R, K], output [L, T, R] (fp32)."""

    x: torch.Tensor
    slices: list[torch.Tensor]
    single: bool  # lora_a was one tensor: the caller gets v as [T, R] rather than [1, T, R]
    num_tokens: int
    num_slots: int
    max_rank: int
    hidden: int
    out: torch.Tensor  # always [L, T, R] fp32, contiguous


def check_shrink(x, lora_a, scales, ranks, out=None) -> ShrinkArgs:
    slices, single = _as_slices(lora_a, "lora_a")
    _check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES)
    device = x.device
    num_tokens, hidden = x.shape
    s0 = slices[0]
    for name, a in _checked_slices(slices, single, "lora_a", x, "x"):
        if a.shape[2] != hidden:
            raise ValueError(f"{name} has shape {tuple(a.shape)} (expected [S, R, {hidden}]): its last dim must equal x's width {hidden}")
        if a.shape[:2] != s0.shape[:2]:
            raise ValueError(f"all lora_a slices must share [S, R]; got {tuple(s0.shape)} and {tuple(a.shape)}")
    num_slots, max_rank = s0.shape[0], s0.shape[1]
    _check_ranks_scales(ranks, scales, num_slots, max_rank, device)
    want = (len(slices), num_tokens, max_rank)
    if out is None:
        out = torch.zeros(want, dtype=torch.float32, device=device)
    else:
        _check_tensor(out, "out", ndim=2 if single else 3, dtypes=(torch.float32,), device=device)
        out3 = out.unsqueeze(0) if single else out
        if tuple(out3.shape) != want:
            raise ValueError(f"out has shape {tuple(out.shape)}; expected {want[1:] if single else want}")
        out = out3
        out.zero_()
    return ShrinkArgs(x, slices, single, num_tokens, num_slots, max_rank, hidden, out)


@dataclass(frozen=True)
class ExpandArgs:
    """Validated expand call: v [L, T, R] fp32, slices of [S, N_i, R], y [T, width]."""

    v: torch.Tensor  # always [L, T, R]
    slices: list[torch.Tensor]
    y: torch.Tensor
    offsets: list[int]
    widths: list[int]
    num_tokens: int
    num_slots: int
    max_rank: int
    packed: bool  # slices fill y's columns side by side from 0


def _packed_offsets(widths: list[int]) -> list[int]:
    return [sum(widths[:i]) for i in range(len(widths))]


def check_expand(v, lora_b, ranks, y, offsets=None) -> ExpandArgs:
    slices, single = _as_slices(lora_b, "lora_b")
    _check_tensor(y, "y", ndim=2, dtypes=FLOAT_DTYPES)
    device = y.device
    _check_tensor(v, "v", ndim=2 if single else 3, dtypes=(torch.float32,), device=device)
    v3 = v.unsqueeze(0) if single else v
    s0 = slices[0]
    for _, b in _checked_slices(slices, single, "lora_b", y, "y"):
        if b.shape[0] != s0.shape[0] or b.shape[2] != s0.shape[2]:
            raise ValueError(f"all lora_b slices must share S and R ([S, N_i, R]); got {tuple(s0.shape)} and {tuple(b.shape)}")
    num_slots, max_rank = s0.shape[0], s0.shape[2]
    num_tokens = y.shape[0]
    want = (len(slices), num_tokens, max_rank)
    if tuple(v3.shape) != want:
        raise ValueError(f"v has shape {tuple(v.shape)}; expected {want[1:] if single else want} "
                         "(the shrink output for these stacks and y's token count)")
    widths = [b.shape[1] for b in slices]
    if offsets is None:
        offsets = _packed_offsets(widths)
    else:
        if isinstance(offsets, int):
            offsets = [offsets]
        offsets = [int(o) for o in offsets]
        if len(offsets) != len(slices):
            raise ValueError(f"got {len(offsets)} offsets for {len(slices)} lora_b slices")
    for o, n in zip(offsets, widths):
        if o < 0 or o + n > y.shape[1]:
            raise ValueError(f"slice columns [{o}, {o + n}) fall outside y's width {y.shape[1]}")
    _check_ranks_scales(ranks, None, num_slots, max_rank, device)
    return ExpandArgs(v3, slices, y, offsets, widths, num_tokens, num_slots, max_rank,
                      offsets == _packed_offsets(widths))


def check_token_slots(token_slots, num_tokens: int, num_slots: int, device) -> None:
    _check_tensor(token_slots, "token_slots", ndim=1, dtypes=INDEX_DTYPES, device=device)
    if token_slots.shape[0] != num_tokens:
        raise ValueError(f"token_slots has {token_slots.shape[0]} entries for {num_tokens} tokens")
    _check_slot_values(token_slots, num_slots, "token_slots")


def check_segments(seg_starts, seg_slots, num_tokens: int, num_slots: int, device) -> None:
    _check_tensor(seg_starts, "seg_starts", ndim=1, dtypes=INDEX_DTYPES, device=device)
    _check_tensor(seg_slots, "seg_slots", ndim=1, dtypes=INDEX_DTYPES, device=device)
    if seg_starts.shape[0] != seg_slots.shape[0] + 1:
        raise ValueError(f"seg_starts must have one more entry than seg_slots; got {seg_starts.shape[0]} and {seg_slots.shape[0]}")
    _check_slot_values(seg_slots, num_slots, "seg_slots")
    if seg_starts.device.type == "cpu":
        st = seg_starts.tolist()
        if st[0] != 0 or st[-1] != num_tokens or any(b < a for a, b in zip(st, st[1:])):
            raise ValueError(f"seg_starts must be non-decreasing from 0 to the token count {num_tokens}; got {st[:8]}{'...' if len(st) > 8 else ''}")


@dataclass(frozen=True, eq=False)
class LoRAStack:
    """One layer's adapter weights for repeated `add_lora` calls, checked once: A slices
    [S, R, K], B slices [S, N_i, R], scales [S] fp32, ranks [S], and the columns of y each slice
    adds into. A caller that makes the same call every step (the engine: 120 a decode step) builds
    it once with `lora_stack` and passes it as `add_lora`'s `lora_a`; each call then checks only
    its activations and the rank values (slots are rewritten in place between steps). The
    tensors are held, not copied: writing into them (a slot load) is seen by the next call.

    int8 stacks (`quantized`) hold each weight as q times its row's scale: A_l[s, j, :] =
    a_slices[l][s, j, :] * a_row_scales[l][s, j] and B_l[s, n, :r] = Q[n] * b_row_scales[l][s, n]
    with Q = int8_b_read(b_slices[l], s, r), r = ranks[s]: slot s's B takes the first N * r
    entries of its [N, R] block, in rank pairs (`int8_b_write`; `quantize_rows` makes q and the
    scales)."""

    a_slices: list[torch.Tensor]
    b_slices: list[torch.Tensor]
    scales: torch.Tensor
    ranks: torch.Tensor
    offsets: list[int]
    widths: list[int]
    packed: bool  # slices fill y's columns side by side from 0
    #: int8 stacks only: fp32 row scales, [S, R] per A slice and [S, N_i] per B slice
    a_row_scales: list[torch.Tensor] | None = None
    b_row_scales: list[torch.Tensor] | None = None
    #: what the checks have already verified of this stack (rank values at a tensor version,
    #: dtype combinations); a path's own per-stack state (the C kernel's argument struct) lives
    #: with that path, keyed by the stack (compared and hashed by identity)
    checked: dict = field(default_factory=dict, repr=False)

    # Cached: the stack's tensors are never reallocated, and a call reads these every time.
    @cached_property
    def num_slots(self) -> int:
        return self.a_slices[0].shape[0]

    @cached_property
    def max_rank(self) -> int:
        return self.a_slices[0].shape[1]

    @cached_property
    def in_features(self) -> int:
        return self.a_slices[0].shape[2]

    @cached_property
    def device(self) -> torch.device:
        return self.a_slices[0].device

    @cached_property
    def min_out_width(self) -> int:
        return max(o + n for o, n in zip(self.offsets, self.widths))

    @property
    def quantized(self) -> bool:
        """int8 weights with row scales."""
        return self.a_row_scales is not None


def _check_row_scales(row_scales, weights: list[torch.Tensor], name: str, device) -> list[torch.Tensor]:
    """An int8 stack's row scales: one fp32 [S, rows] tensor per slice, rows = the slice's dim 1."""
    if row_scales is None:
        raise TypeError(f"int8 stacks need {name} (fp32 row scales; punica_kernels.quantize_rows makes them)")
    slices, _ = _as_slices(row_scales, name)
    if len(slices) != len(weights):
        raise ValueError(f"got {len(slices)} {name} for {len(weights)} slices")
    for i, (rs, w) in enumerate(zip(slices, weights)):
        _check_tensor(rs, f"{name}[{i}]", ndim=2, dtypes=(torch.float32,), device=device)
        if tuple(rs.shape) != tuple(w.shape[:2]):
            raise ValueError(f"{name}[{i}] has shape {tuple(rs.shape)}; expected {list(w.shape[:2])} (one per row)")
    return slices


def lora_stack(lora_a, lora_b, scales, ranks, offsets=None, *, a_row_scales=None, b_row_scales=None) -> LoRAStack:
    """Check a layer's stacks once (the `add_lora` checks that do not involve x and y).

    int8 `lora_a` / `lora_b` need `a_row_scales` / `b_row_scales` (a tensor or a sequence, as the
    weights: [S, R] and [S, N_i] fp32); float stacks take none."""
    a_slices, single_a = _as_slices(lora_a, "lora_a")
    b_slices, single_b = _as_slices(lora_b, "lora_b")
    if single_a != single_b or len(a_slices) != len(b_slices):
        raise ValueError(f"lora_a and lora_b must have the same number of slices; got {len(a_slices)} and {len(b_slices)}")
    a0 = a_slices[0]
    _check_tensor(a0, "lora_a[0]", ndim=3, dtypes=STACK_DTYPES)  # before reading its shape
    S, R, K = a0.shape
    device = a0.device
    for i, (a, b) in enumerate(zip(a_slices, b_slices)):
        _check_tensor(a, f"lora_a[{i}]", ndim=3, dtypes=STACK_DTYPES, device=device)
        _check_tensor(b, f"lora_b[{i}]", ndim=3, dtypes=STACK_DTYPES, device=device)
        if tuple(a.shape) != (S, R, K):
            raise ValueError(f"lora_a[{i}] has shape {tuple(a.shape)}; expected [{S}, {R}, {K}] (lora_a[0]'s)")
        if b.shape[0] != S or b.shape[2] != R:
            raise ValueError(f"lora_b[{i}] has shape {tuple(b.shape)}; expected [{S}, N, {R}]")
    _check_ranks_scales(ranks, scales, S, R, device)
    int8 = [w.dtype == torch.int8 for w in a_slices + b_slices]
    if any(int8):
        if not all(int8):
            raise TypeError("an int8 stack must be int8 in every lora_a and lora_b slice")
        a_row_scales = _check_row_scales(a_row_scales, a_slices, "a_row_scales", device)
        b_row_scales = _check_row_scales(b_row_scales, b_slices, "b_row_scales", device)
    elif a_row_scales is not None or b_row_scales is not None:
        raise TypeError("row scales go with int8 stacks only; these weights are float")
    widths = [b.shape[1] for b in b_slices]
    packed_offsets = _packed_offsets(widths)
    if offsets is None:
        offsets = packed_offsets
    else:
        offsets = [int(o) for o in ([offsets] if isinstance(offsets, int) else offsets)]
        if len(offsets) != len(b_slices):
            raise ValueError(f"got {len(offsets)} offsets for {len(b_slices)} lora_b slices")
        if any(o < 0 for o in offsets):
            raise ValueError(f"slice offsets must be >= 0; got {offsets}")
    return LoRAStack(a_slices, b_slices, scales, ranks, offsets, widths, offsets == packed_offsets,
                     a_row_scales, b_row_scales)


class AddLoRAArgs(NamedTuple):
    """Validated fused call: x [T, K], A slices [S, R, K], B slices [S, N_i, R], y [T, width]."""

    x: torch.Tensor
    y: torch.Tensor
    stack: LoRAStack

    @property
    def a_slices(self) -> list[torch.Tensor]:
        return self.stack.a_slices

    @property
    def b_slices(self) -> list[torch.Tensor]:
        return self.stack.b_slices

    @property
    def offsets(self) -> list[int]:
        return self.stack.offsets

    @property
    def widths(self) -> list[int]:
        return self.stack.widths

    @property
    def packed(self) -> bool:
        return self.stack.packed


def _compact_weights(x, y, a, b) -> bool:
    """add_lora's mixed forms: CPU stacks stored as bf16 or int8 (a half or a quarter of the bytes
    a decode step reads), fp32 activations and output."""
    return (x.device.type == "cpu" and x.dtype == y.dtype == torch.float32
            and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.int8))


def _check_stack_ranks(stack: LoRAStack) -> None:
    """A stack's rank values, re-checked only after a write into them: torch bumps a tensor's
    version counter on every in-place change (through any view), and the engine's calls (120 a
    decode step) see the same ranks until the next slot load."""
    version = stack.ranks._version
    if stack.checked.get("ranks_checked") != version:
        _check_rank_values(stack.ranks, stack.max_rank)
        stack.checked["ranks_checked"] = version


def check_add_lora(y, x, lora_a, lora_b=None, scales=None, ranks=None, offsets=None) -> AddLoRAArgs:
    """Checks of shrink (x, A, scales, ranks) and expand (B, y, offsets) with no intermediate to
    allocate: the fused op never materialises v in token order. `lora_a` may be a `LoRAStack`
    (then lora_b, scales, ranks and offsets stay None): only x, y and the rank values are checked."""
    if isinstance(lora_a, LoRAStack):
        if lora_b is not None or scales is not None or ranks is not None or offsets is not None:
            raise TypeError("with a LoRAStack, pass no lora_b, scales, ranks or offsets (the stack holds them)")
        stack = lora_a
        _check_stack_ranks(stack)
    else:
        if lora_b is None or scales is None or ranks is None:
            raise TypeError("add_lora needs lora_b, scales and ranks (or a LoRAStack as lora_a)")
        stack = lora_stack(lora_a, lora_b, scales, ranks, offsets)
    _check_tensor(x, "x", ndim=2, dtypes=FLOAT_DTYPES, device=stack.device)
    _check_tensor(y, "y", ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"y has {y.shape[0]} rows but x has {x.shape[0]} tokens")
    if x.shape[1] != stack.in_features:
        raise ValueError(f"lora_a has shape {tuple(stack.a_slices[0].shape)}; expected "
                         f"[{stack.num_slots}, {stack.max_rank}, {x.shape[1]}] (x's width)")
    dtypes_ok = ("dtypes_ok", x.dtype, y.dtype, x.device.type)  # the answer depends on nothing else
    if dtypes_ok not in stack.checked:
        for i, (a, b) in enumerate(zip(stack.a_slices, stack.b_slices)):
            if (a.dtype != x.dtype or b.dtype != y.dtype) and not _compact_weights(x, y, a, b):
                raise TypeError(f"slice {i}: lora_a must match x's dtype and lora_b y's (or, on CPU, both be "
                                f"bfloat16 or int8 with float32 x and y); got {_dtype_name(a.dtype)}/"
                                f"{_dtype_name(x.dtype)} and {_dtype_name(b.dtype)}/{_dtype_name(y.dtype)}")
        stack.checked[dtypes_ok] = True
    if stack.min_out_width > y.shape[1]:
        o, n = next((o, n) for o, n in zip(stack.offsets, stack.widths) if o + n > y.shape[1])
        raise ValueError(f"slice columns [{o}, {o + n}) fall outside y's width {y.shape[1]}")
    return AddLoRAArgs(x, y, stack)
