"""Device slots for adapters (the step's LoRA batch that reads them is the backend's:
engine.backends.base.LoRABatch).

The slot stacks hold, per (layer, fused group), one zero-padded A and B stack per slice:
    qkv:     A q/k/v [S, R, hidden]      B q [S, q, R], k/v [S, kv, R]
    o:       A [S, R, q]                 B [S, hidden, R]
    gate_up: A gate/up [S, R, hidden]    B gate/up [S, inter, R]
    down:    A [S, R, inter]             B [S, hidden, R]
A module an adapter does not target reads as zero in its slot. Each (layer, group) stack has its
own per-slot rank and scale, rows of `ranks` [L * G, S] and `scales` [L * G, S] (row
`row_of[(layer, group)]`, the stack's `LoRAStack.ranks` / `.scales` views): a slot's
rank there is its adapter's largest rank among the group's modules in that layer (0 where it
targets none), so punica_kernels does work proportional to it, not to R nor to the adapter's
largest rank elsewhere. A module of smaller rank than its group's is zero-padded to it, and its
B carries its scale relative to the group's (LoRAWeights.group_scale). int8 slots also hold each row's fp32
scale: `a_rs[(layer, module)]` [S, R] and `b_rs[(layer, module)]` [S, out] (the adapters arrive
quantized: LoRAWeights.quantized).

Slot loads: an adapter is prepared once, off the step thread, into a `SlotImage` (`prepare`):
one host buffer holding every byte a slot write copies, pinned where the slots are on CUDA. A
write (`write`) is then one asynchronous host-to-device copy of that buffer into a device staging
buffer and one device copy per module into the stacks. That takes one copy per module, not one
per (layer, module), because every module's stacks lie at one stride from layer to layer in a
single store, so a module's slot rows in every layer are one strided view.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import punica_kernels
from engine.config import ModelConfig
from engine.lora.weights import GROUPS, LoRAWeights

__all__ = ["GROUPS", "LoRASlots", "SlotImage"]

# Every stack and every section of a slot image starts on this byte boundary: as aligned as
# separate allocations would be, so the kernels' and the copies' vectorized accesses stay legal.
_ALIGN_BYTES = 512

_GROUP_OF = {m: group for group, mods in GROUPS.items() for m in mods}


@dataclass(frozen=True)
class _Section:
    """One part of a slot image: the rows a slot write copies into `kind` ("a", "b", "a_rs",
    "b_rs") of `module` in every layer (first `rows` rows of A / row scales, B's first `rows`
    columns, int8 B's first out * rows entries, all of b_rs), from byte `offset` of the image."""

    kind: str
    module: str
    rows: int
    offset: int


@dataclass(frozen=True, eq=False)
class SlotImage:
    """An adapter as `LoRASlots.write` copies it (made by `LoRASlots.prepare`): `buffer` (uint8,
    host memory; pinned where the slots are on CUDA) holds the ranks and scales of every
    (layer, group) stack and each section's rows for all layers, in the slots' dtype and layout.
    A module's rows are the largest rank its group has in any layer: in a layer of smaller group
    rank, or one where the adapter does not target the module, they are zero (padding the stack
    never reads past the slot's rank, or the zero of an untargeted module). Modules in `zeros`
    are targeted in no layer: the write zeroes them, with no bytes in the buffer.

    The buffer must not be written after `prepare` (a write may still be copying it)."""

    version: str
    rank: int
    quantized: bool
    layout: tuple  # the geometry of the slots it was prepared for (LoRASlots.layout)
    buffer: torch.Tensor
    sections: tuple[_Section, ...]
    zeros: tuple[str, ...]
    pinned: bool

    @property
    def nbytes(self) -> int:
        """The host memory the image holds: its buffer, or where pinned the block torch's pinned-memory
        allocator took for it (it rounds every allocation up to a power of two)."""
        n = self.buffer.numel()
        return 1 << (n - 1).bit_length() if self.pinned and n > 1 else n


class LoRASlots:
    """`num_slots` adapter slots of rank <= `max_rank` for every layer (the device tier)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype, device="cpu"):
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dims = {
            "q": (cfg.hidden_size, cfg.q_size), "k": (cfg.hidden_size, cfg.kv_size),
            "v": (cfg.hidden_size, cfg.kv_size), "o": (cfg.q_size, cfg.hidden_size),
            "gate": (cfg.hidden_size, cfg.intermediate_size), "up": (cfg.hidden_size, cfg.intermediate_size),
            "down": (cfg.intermediate_size, cfg.hidden_size),
        }
        L, S, R = cfg.num_layers, num_slots, max_rank
        self.num_layers = L
        self.dtype = dtype
        self.device = torch.device(device)
        self.quantized = dtype == torch.int8
        #: What a SlotImage must have been prepared for to be written here.
        self.layout = (L, R, dtype, tuple(self.dims.items()))
        # One store per element type, layer-major: (layer, module)'s stacks start at
        # layer * stride + the module's offset, so `_all[(kind, module)]` views them for every layer.
        weights = _Store(dtype)
        for m, (fan_in, fan_out) in self.dims.items():
            weights.add(("a", m), (S, R, fan_in))
            weights.add(("b", m), (S, fan_out, R))
        scale_store = _Store(torch.float32)
        if self.quantized:
            for m, (_, fan_out) in self.dims.items():
                scale_store.add(("a_rs", m), (S, R))
                scale_store.add(("b_rs", m), (S, fan_out))
        self._all: dict[tuple[str, str], torch.Tensor] = {}
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        self.a_rs: dict[tuple[int, str], torch.Tensor] = {}
        self.b_rs: dict[tuple[int, str], torch.Tensor] = {}
        for store, per_layer in ((weights, {"a": self.a, "b": self.b}),
                                 (scale_store, {"a_rs": self.a_rs, "b_rs": self.b_rs})):
            for key, view in store.allocate(L, self.device).items():
                self._all[key] = view
                for layer in range(L):
                    per_layer[key[0]][(layer, key[1])] = view[layer]
        keys_in_order = [(layer, group) for layer in range(L) for group in GROUPS]
        self.row_of: dict[tuple[int, str], int] = {k: i for i, k in enumerate(keys_in_order)}
        # Ranks and scales (as int32 bits) in one tensor, so a write sets a slot's column of both
        # with one copy.
        self._meta = torch.zeros(2, len(keys_in_order), S, dtype=torch.int32, device=device)
        self.ranks = self._meta[0]
        self.scales = self._meta[1].view(torch.float32)
        self.offsets = {"qkv": [0, cfg.q_size, cfg.q_size + cfg.kv_size], "gate_up": [0, cfg.intermediate_size]}
        # Each (layer, group)'s stacks checked once for punica_kernels.add_lora: a decode step makes
        # 4 calls a layer, and the stacks do not change between calls, so only the activations
        # are checked per call.
        self.stacks: dict[tuple[int, str], punica_kernels.LoRAStack] = {}
        for layer in range(L):
            for group, mods in GROUPS.items():
                keys = [(layer, m) for m in mods]
                ranks, scales = self.ranks[self.row_of[(layer, group)]], self.scales[self.row_of[(layer, group)]]
                row_scales = {"a_row_scales": [self.a_rs[k] for k in keys],
                              "b_row_scales": [self.b_rs[k] for k in keys]} if self.quantized else {}
                self.stacks[(layer, group)] = punica_kernels.lora_stack(
                    [self.a[k] for k in keys], [self.b[k] for k in keys], scales, ranks,
                    self.offsets.get(group), **row_scales)
        # Off the host, writes copy an image into this device buffer first. Sized for the largest
        # image (every module at max_rank) and allocated now, so the memory it takes is counted
        # before the KV cache is sized from what is left.
        self._staging = None
        if self.device.type != "cpu":
            full = {m: max_rank for m in self.dims}
            self._staging = torch.empty(self._image_plan(full, {})[1], dtype=torch.uint8, device=device)

    # -- slot images ----------------------------------------------------------------------------

    def prepare(self, w: LoRAWeights) -> SlotImage:
        """Adapter `w` as a write copies it (see SlotImage), in host memory pinned where the slots
        are on CUDA. Runs off the step thread (the manager's loader): it copies every tensor of `w`
        once. Raises ValueError where `w` cannot go in these slots (see `write`)."""
        self._check(w.version, w.quantized, w.rank)
        L = self.num_layers
        rows: dict[str, int] = {}
        zeros: list[str] = []
        for group, mods in GROUPS.items():
            group_rows = max((w.group_rank.get((layer, group), 0) for layer in range(L)), default=0)
            for m in mods:
                if any((layer, m) in w.a for layer in range(L)):
                    rows[m] = group_rows
                else:
                    zeros.append(m)
        # A fused module's slices share their A tensors (and int8 row scales): one section each.
        shared = {(kind, m): tuple(id(d.get((layer, m))) for layer in range(L))
                  for kind, d in (("a", w.a), ("a_rs", w.a_scale or {})) for m in rows}
        sections, nbytes = self._image_plan(rows, shared)
        pinned = self.device.type == "cuda"
        buffer = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pinned)

        meta = self._source(buffer, None).view(2, len(self.row_of))
        ranks, scales = [0] * len(self.row_of), [0.0] * len(self.row_of)
        for key, row in self.row_of.items():
            ranks[row] = w.group_rank.get(key, 0)
            scales[row] = w.group_scale.get(key, 0.0)
        meta[0].copy_(torch.tensor(ranks, dtype=torch.int32))
        meta[1].copy_(torch.tensor(scales, dtype=torch.float32).view(torch.int32))
        filled = set()
        for s in sections:
            if s.offset in filled:
                continue  # a shared section, already filled
            filled.add(s.offset)
            part = self._source(buffer, s)
            for layer in range(L):
                key = (layer, s.module)
                if key not in w.a:
                    continue  # stays zero
                rm, rg = w.a[key].shape[0], w.group_rank[(layer, _GROUP_OF[s.module])]
                if s.kind == "a":
                    part[layer, :rm].copy_(w.a[key])
                elif s.kind == "a_rs":
                    part[layer, :rm].copy_(w.a_scale[key])
                elif s.kind == "b_rs":
                    part[layer].copy_(w.b_scale[key])
                elif self.quantized:  # B at the group's rank in rank pairs (punica_kernels.int8_b_write)
                    b = w.b[key]
                    if rm < rg:  # zero-padded to the group's rank
                        b = torch.cat([b, b.new_zeros(b.shape[0], rg - rm)], dim=1)
                    part[layer, :b.shape[0] * rg].copy_(punica_kernels.pack_int8_b(b))
                else:
                    part[layer, :, :rm].copy_(w.b[key])
        return SlotImage(version=w.version, rank=w.rank, quantized=w.quantized, layout=self.layout,
                         buffer=buffer, sections=tuple(sections), zeros=tuple(zeros), pinned=pinned)

    def _image_plan(self, rows: dict[str, int], shared: dict[tuple[str, str], tuple]) -> tuple[list[_Section], int]:
        """(sections, total bytes) of an image whose modules `rows` have those rows; the sections of
        one kind whose (kind, module) have equal `shared` keys share their bytes. The ranks and
        scales come first."""
        offset = _aligned(2 * len(self.row_of) * 4)
        sections: list[_Section] = []
        first_of: dict[tuple, _Section] = {}
        for m, r in rows.items():
            for kind in self._kinds:
                share = (kind, shared[(kind, m)], r) if (kind, m) in shared else None
                if share is not None and share in first_of:
                    sections.append(_Section(kind, m, r, first_of[share].offset))
                    continue
                s = _Section(kind, m, r, offset)
                if share is not None:
                    first_of[share] = s
                sections.append(s)
                shape, dtype = self._section_shape(s)
                offset += _aligned(_numel(shape) * dtype.itemsize)
        return sections, offset

    @property
    def _kinds(self) -> tuple[str, ...]:
        """The per-module tensors a slot holds: A and B, and int8 slots' row scales."""
        return ("a", "b", "a_rs", "b_rs") if self.quantized else ("a", "b")

    def _section_shape(self, s: _Section) -> tuple[tuple[int, ...], torch.dtype]:
        fan_in, fan_out = self.dims[s.module]
        L = self.num_layers
        return {
            "a": ((L, s.rows, fan_in), self.dtype),
            "b": ((L, fan_out * s.rows) if self.quantized else (L, fan_out, s.rows), self.dtype),
            "a_rs": ((L, s.rows), torch.float32),
            "b_rs": ((L, fan_out), torch.float32),
        }[s.kind]

    def _source(self, buffer: torch.Tensor, s: _Section | None) -> torch.Tensor:
        """Section `s` of an image held in `buffer` (the image's host buffer or the device
        staging), typed and shaped; None: the ranks and scales, int32 [2 * L * G]."""
        if s is None:
            return buffer[:2 * len(self.row_of) * 4].view(torch.int32)
        shape, dtype = self._section_shape(s)
        return buffer[s.offset:s.offset + _numel(shape) * dtype.itemsize].view(dtype).view(shape)

    def _target(self, s: _Section, slot: int) -> torch.Tensor:
        """Where section `s` goes in `slot`: one strided view over every layer's stack."""
        stacks = self._all[(s.kind, s.module)][:, slot]  # [L, R, in] / [L, out, R] / [L, R] / [L, out]
        if s.kind == "b" and self.quantized:  # the first out * rows entries of each [out, R] block
            return stacks.flatten(1)[:, :stacks.shape[1] * s.rows]
        if s.kind == "b":
            return stacks[:, :, :s.rows]
        return stacks[:, :s.rows] if s.kind in ("a", "a_rs") else stacks

    # -- slot writes ----------------------------------------------------------------------------

    def write(self, slot: int, adapter: SlotImage | LoRAWeights) -> int:
        """Copy `adapter` into `slot` (an image from `prepare`, or LoRAWeights, prepared here);
        returns the host-to-device transfers it made (1 off the host, 0 on CPU).

        The adapter is quantized exactly when the slots are (the manager loads adapters in the
        slots' dtype) and of rank <= max_rank, else ValueError before anything is written. Off
        the host the write is asynchronous: it is ordered on the current stream before the next
        step's kernels, and the image's pinned buffer may be freed at once (torch's pinned-memory
        allocator keeps a block from reuse until the copies recorded on it are done).

        Only the first r rows of A and columns of B (int8: B's first N * r entries) and their
        scales are ever read for a slot of rank r in a stack (punica_kernels' contract): the write
        fills them (the adapter's rows, zero padding up to its group's rank, zeros where a module
        is not targeted in a layer); rows past every layer's group rank keep what they held."""
        image = adapter if isinstance(adapter, SlotImage) else self.prepare(adapter)
        self._check(image.version, image.quantized, image.rank)
        if image.layout != self.layout:
            raise ValueError(f"adapter {image.version} was prepared for slots of another model, rank or dtype")
        source, transfers = image.buffer, 0
        if self._staging is not None:
            source = self._staging[:image.buffer.numel()]
            source.copy_(image.buffer, non_blocking=True)
            transfers = 1
        for s in image.sections:
            self._target(s, slot).copy_(self._source(source, s))
        for m in image.zeros:
            for kind in self._kinds:
                self._all[(kind, m)][:, slot].zero_()
        self._meta[:, :, slot].copy_(self._source(source, None).view(2, len(self.row_of)))
        return transfers

    def _check(self, version: str, quantized: bool, rank: int) -> None:
        if quantized != self.quantized:
            raise ValueError(f"adapter {version} is {'' if quantized else 'not '}int8 but the slots are "
                             f"{'' if self.quantized else 'not '}int8")
        if rank > self.max_rank:
            raise ValueError(f"adapter {version} has rank {rank}, above the slots' {self.max_rank}")

    def rank_in(self, slot: int, layer: int, group: str) -> int:
        """The rank slot `slot` has in the (layer, group) stack (the work its tokens cost there)."""
        return int(self.ranks[self.row_of[(layer, group)], slot])

    def clear(self, slot: int) -> None:
        self.ranks[:, slot] = 0
        self.scales[:, slot] = 0.0


class _Store:
    """Stacks of one element type in a single allocation, layer-major: each added stack gets an
    offset inside a layer's block, every layer's block the same stride (aligned to _ALIGN_BYTES)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.shapes: dict[tuple[str, str], tuple[tuple[int, ...], int]] = {}
        self.stride = 0

    def add(self, key: tuple[str, str], shape: tuple[int, ...]) -> None:
        self.shapes[key] = (shape, self.stride)
        self.stride += _aligned(_numel(shape) * self.dtype.itemsize) // self.dtype.itemsize

    def allocate(self, num_layers: int, device) -> dict[tuple[str, str], torch.Tensor]:
        """Zeroed storage; per key a view [num_layers, *shape] (layer `l` is a contiguous stack)."""
        if not self.shapes:
            return {}
        flat = torch.zeros(num_layers * self.stride, dtype=self.dtype, device=device)
        views = {}
        for key, (shape, offset) in self.shapes.items():
            strides = [1] * len(shape)
            for i in range(len(shape) - 2, -1, -1):
                strides[i] = strides[i + 1] * shape[i + 1]
            views[key] = flat.as_strided((num_layers, *shape), (self.stride, *strides), offset)
        return views


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
