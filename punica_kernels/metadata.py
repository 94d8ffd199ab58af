"""Per-step LoRA batch metadata: one slot list in, what SGMV, BGMV and the CPU path need out.

Tokens are never permuted: segments are runs of equal slots in the batch's own token order
(a prefill sequence's tokens are contiguous, so each becomes one segment), and the BGMV kernels
read each token's slot directly. The tensors' shapes depend only on the token count and the
run structure; a decode step captured in a CUDA graph copies `token_slots` (shape [T], fixed
for the batch size) into its static buffer and the decode launch shapes stay the same.

A mixed batch puts its decode tokens first (`num_decode`, one per sequence) and its prefill
chunks after them; the Triton `add_lora` then runs the grouped kernels over the decode rows and
SGMV over the prefill rows' own segments (`prefill_seg_starts`, relative to row `num_decode`). Everything a
launch needs on the host (`max_segment_len`, `prefill_max_segment_len`, `num_decode`) is a host
int computed here, so no launch reads a device tensor back.

Decode rows are grouped by adapter for the grouped kernels (`DecodeGroups`, `group_decode_tokens`)
on the device, from the token_slots tensor alone: a captured decode graph's only per-step LoRA
input is its static slot buffer, so the grouping is recomputed inside the graph, once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(eq=False)
class LoRAMetadata:
    """What the four ops need for one batch. All tensors live on `device`. Compared and hashed by
    identity: a path's own per-batch caches (the CPU path's token plans) key on the object and
    live with that path, not here."""

    token_slots: torch.Tensor  # [T] int32: slot of each token, -1 = no adapter (BGMV input)
    seg_starts: torch.Tensor  # [n+1] int32: boundaries of runs of equal slots (SGMV input)
    seg_slots: torch.Tensor  # [n] int32: slot of each run, -1 = no adapter (SGMV input)
    max_segment_len: int  # longest run, host int: SGMV grid height without a device sync
    sorted_tokens: torch.Tensor  # [T'] int64: tokens that have an adapter, stably sorted by slot
    distinct_slots: torch.Tensor  # [U] int32: distinct slots in use (ascending, -1 excluded)
    distinct_slots_list: tuple[int, ...]  # the same on the host (for loaders and the scheduler)
    num_tokens: int  # T
    num_slots: int | None  # size of the slot stack the slots were checked against, if given
    # Tokens [0, num_decode) are decode tokens, the rest prefill chunks. None: not given, and the
    # Triton add_lora runs BGMV over every token (a launch shape fixed by T alone).
    num_decode: int | None = None
    # Runs of equal slots among the prefill tokens alone, boundaries relative to row num_decode
    # (SGMV input for x[num_decode:]); [0] and [] when there are none.
    prefill_seg_starts: torch.Tensor | None = None  # [m+1] int32
    prefill_seg_slots: torch.Tensor | None = None  # [m] int32
    prefill_max_segment_len: int = 0  # longest prefill run, host int
    # The decode rows grouped by slot (`group_decode_tokens`), set by a caller that reuses it for
    # every layer of a step (the Triton backend's batch); None: add_lora groups them per call.
    decode_groups: DecodeGroups | None = None

    @property
    def decode_slots(self) -> torch.Tensor:
        """token_slots[:num_decode] (a view): the BGMV input for the decode rows."""
        return self.token_slots[: self.num_decode or 0]


@dataclass(frozen=True, eq=False)
class DecodeGroups:
    """Rows grouped by slot, on the device, for the grouped shrink and expand kernels:
    slot s's rows (ascending) are order[bounds[s]:bounds[s+1]] for s in [0, S), and the rows
    without an adapter (slot -1) are order[bounds[S]:bounds[S+1]] (bounds[S+1] = T). Shapes
    depend on T and S alone, so a kernel's launch grid does too."""

    order: torch.Tensor  # [T] int64: row indices sorted stably by slot, slot -1 last
    bounds: torch.Tensor  # [S + 2] int64: where each slot's rows start in `order`, then T
    num_slots: int  # S

    @property
    def num_tokens(self) -> int:
        return self.order.shape[0]


def group_decode_tokens(token_slots: torch.Tensor, num_slots: int) -> DecodeGroups:
    """Group rows by slot on token_slots' device (a few small launches: a remainder, a stable
    sort, a searchsorted), without reading a value back, so it runs inside a captured graph.

    Args:
        token_slots: [T] int32/int64, slot per row in [-1, num_slots) (-1 = no adapter; values
            are not checked here: build_lora_metadata checks them on the host).
        num_slots: S, the stacks' slot count.
    """
    if (not isinstance(token_slots, torch.Tensor) or token_slots.dim() != 1
            or token_slots.dtype not in (torch.int32, torch.int64)):
        raise TypeError("token_slots must be a 1-D int32/int64 tensor")
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    # -1 -> S (torch.remainder takes the divisor's sign), so the no-adapter rows sort last.
    key = torch.remainder(token_slots.to(torch.int64), num_slots + 1)
    sorted_key, order = torch.sort(key, stable=True)
    edges = torch.arange(num_slots + 2, dtype=torch.int64, device=token_slots.device)
    bounds = torch.searchsorted(sorted_key, edges)
    return DecodeGroups(order=order, bounds=bounds, num_slots=num_slots)


def build_lora_metadata(slot_per_token: Sequence[int] | torch.Tensor, *, num_slots: int | None = None,
                        device: torch.device | str | None = None, num_decode: int | None = None) -> LoRAMetadata:
    """Turn a per-token slot list into the kernels' metadata, without permuting tokens.

    Args:
        slot_per_token: [T] ints (list or 1-D integer tensor); -1 = no adapter.
        num_slots: size S of the weight stacks; when given, every slot must be in [-1, S).
        device: where the tensors go (default: the input tensor's device, else CPU).
        num_decode: how many leading tokens are decode tokens (one per sequence); the rest are
            prefill chunks, each sequence's tokens contiguous. The Triton `add_lora` runs BGMV
            over the first num_decode rows and SGMV over the rest's runs of equal slots
            (num_decode=0: all prefill, SGMV only; num_decode=T: BGMV only). None (the default):
            BGMV over every token, a launch shape that depends on T alone. The CPU path ignores it.
    Raises:
        TypeError if the slots or num_decode are not integers; ValueError if a slot is out of
        range or num_decode is outside [0, T].
    """
    if isinstance(slot_per_token, torch.Tensor):
        if slot_per_token.dtype.is_floating_point or slot_per_token.dtype == torch.bool or slot_per_token.dim() != 1:
            raise TypeError(f"slot_per_token must be a 1-D integer tensor; got {slot_per_token.dtype} {tuple(slot_per_token.shape)}")
        if device is None:
            device = slot_per_token.device
        slots = slot_per_token.detach().to("cpu", torch.int64)
    else:
        vals = list(slot_per_token)
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in vals):
            raise TypeError("slot_per_token must hold ints (-1 for no adapter)")
        slots = torch.tensor(vals, dtype=torch.int64)
    device = torch.device(device if device is not None else "cpu")
    T = slots.shape[0]
    if num_decode is not None:
        if not isinstance(num_decode, int) or isinstance(num_decode, bool):
            raise TypeError(f"num_decode must be an int, got {type(num_decode).__name__}")
        if not 0 <= num_decode <= T:
            raise ValueError(f"num_decode={num_decode} is outside [0, {T}] (the token count)")
    if T:
        lo, hi = int(slots.min()), int(slots.max())
        if lo < -1:
            raise ValueError(f"slot {lo} is invalid: slots are >= 0, or -1 for no adapter")
        if num_slots is not None and hi >= num_slots:
            raise ValueError(f"slot {hi} is out of range for {num_slots} slots")
    starts, run_slots, max_len = _runs(slots)
    p_starts, p_slots, p_max = _runs(slots[num_decode or 0:])
    has = (slots >= 0).nonzero().squeeze(1)
    sorted_tokens = has[torch.argsort(slots[has], stable=True)]
    distinct = torch.unique(slots[has])
    return LoRAMetadata(
        token_slots=slots.to(device=device, dtype=torch.int32),
        seg_starts=starts.to(device=device, dtype=torch.int32),
        seg_slots=run_slots.to(device=device, dtype=torch.int32),
        max_segment_len=max_len,
        sorted_tokens=sorted_tokens.to(device),
        distinct_slots=distinct.to(device=device, dtype=torch.int32),
        distinct_slots_list=tuple(distinct.tolist()),
        num_tokens=T,
        num_slots=num_slots,
        num_decode=num_decode,
        prefill_seg_starts=p_starts.to(device=device, dtype=torch.int32),
        prefill_seg_slots=p_slots.to(device=device, dtype=torch.int32),
        prefill_max_segment_len=p_max,
    )


def _runs(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Runs of equal slots (CPU int64): (boundaries [n+1] from 0, slot of each run [n], longest run)."""
    if not slots.numel():
        return torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 0
    run_slots, run_lens = torch.unique_consecutive(slots, return_counts=True)
    starts = torch.zeros(run_lens.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(run_lens, 0, out=starts[1:])
    return starts, run_slots, int(run_lens.max())
