"""What every launcher shares: the device-side slice tables, and where the kernels can run.

Where: `triton.jit` builds each kernel either for the GPU or for the interpreter, by
TRITON_INTERPRET at the moment the kernel modules are imported (not at call time). Compiled
kernels take CUDA tensors only; interpreted ones take CPU tensors only (the slice tables hold raw
data pointers, which the interpreter dereferences on the host). `check_runnable` turns a mismatch
into a RuntimeError rather than a crash.

Tables: several slices (q, k, v stacks) are separate tensors, so one launch reaches them through a
small int64 table of data pointers, plus a table of each slice's width and output column
offset. The tables are cached by (device, pointers, widths, offsets): the engine's slot stacks
live for the whole run, so after the first step no host-to-device copy happens, which CUDA
graph capture requires.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.runtime.jit import JITFunction


@triton.jit
def _probe():
    pass


#: Whether this process's Triton kernels were built for the interpreter (TRITON_INTERPRET=1 when
#: triton.jit code was first imported): the kernels beside this module, and the engine's Triton
#: backend kernels (engine/backends/triton), are decorated in the same process, so this probe was
#: built the same way.
INTERPRETED: bool = not isinstance(_probe, JITFunction)

if INTERPRETED:
    from punica_kernels.kernels import _interpreter

    _interpreter.install()  # triton.language patched once per launch (see its docstring)


def check_runnable(device: torch.device, what: str = "punica_kernels", cpu_hint: str = ", or use impl='cpu'") -> None:
    """Raise RuntimeError unless this process's Triton kernels can run on tensors of `device`
    (`what` names the kernels in the message; `cpu_hint` ends the CPU one)."""
    if device.type == "cuda":
        if INTERPRETED:
            raise RuntimeError(
                f"{what}'s Triton kernels were built for the interpreter (TRITON_INTERPRET=1 was set "
                "when they were imported), which runs on CPU tensors only; for CUDA tensors start the "
                "process without TRITON_INTERPRET")
    elif device.type == "cpu":
        if not INTERPRETED:
            raise RuntimeError(
                f"{what}'s Triton kernels on CPU tensors need the Triton interpreter: set "
                f"TRITON_INTERPRET=1 before triton.jit code is imported{cpu_hint}")
    else:
        raise ValueError(f"{what} runs on CUDA or CPU tensors, not {device.type}")


def common_device(*tensors: torch.Tensor, what: str) -> torch.device:
    """The one device of `tensors`, checked to be one `what`'s Triton kernels run on (ValueError
    for mixed devices, check_runnable's errors otherwise)."""
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device: {device} and {t.device}")
    check_runnable(device, what, cpu_hint="")
    return device


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str:
    """The key of a device in the kernels' launch-config tables: the CUDA device's name, or
    "interpreter" for CPU tensors."""
    return "interpreter" if device.type == "cpu" else torch.cuda.get_device_name(device)


_TABLE_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_TABLE_CACHE_MAX = 4096


def slice_tables(slices: list[torch.Tensor], widths: list[int], offsets: list[int]):
    """-> (int64 [L] data pointers, int64 [2, L] rows (width, column offset)), on the slices' device."""
    device = slices[0].device
    key = (device, tuple(t.data_ptr() for t in slices), tuple(widths), tuple(offsets))
    hit = _TABLE_CACHE.get(key)
    if hit is not None:
        return hit
    if len(_TABLE_CACHE) >= _TABLE_CACHE_MAX:
        _TABLE_CACHE.clear()
    ptrs = torch.tensor([t.data_ptr() for t in slices], dtype=torch.int64, device=device)
    geo = torch.tensor([widths, offsets], dtype=torch.int64, device=device)
    _TABLE_CACHE[key] = (ptrs, geo)
    return ptrs, geo


_OFFSET_CACHE: dict[tuple, tuple[torch.Tensor, int]] = {}


def slice_offsets(slices: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """-> (int64 [L] offsets of each slice's data from slices[0]'s, in units of `unit` elements;
    unit), on the slices' device. A kernel reaches slice l as `s0_ptr + offsets[l] * UNIT` with
    UNIT a constexpr: when every slice starts on a 16-byte boundary, unit is 16 bytes' worth of
    elements, so the compiler knows each slice's alignment (a raw pointer read from a table has
    none) and can use 16-byte loads; otherwise unit is 1. Cached like `slice_tables`."""
    device = slices[0].device
    key = (device, tuple(t.data_ptr() for t in slices), slices[0].element_size())
    hit = _OFFSET_CACHE.get(key)
    if hit is not None:
        return hit
    if len(_OFFSET_CACHE) >= _TABLE_CACHE_MAX:
        _OFFSET_CACHE.clear()
    item = slices[0].element_size()
    base = slices[0].data_ptr()
    unit = 16 // item if all(t.data_ptr() % 16 == 0 for t in slices) else 1
    offsets = [(t.data_ptr() - base) // (unit * item) for t in slices]
    table = torch.tensor(offsets, dtype=torch.int64, device=device)
    _OFFSET_CACHE[key] = (table, unit)
    return table, unit


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether a kernel's tl.dot runs on fp32 tiles (IEEE products) for inputs of `dtype`.

    fp32 inputs always do (TF32 would keep only 10 mantissa bits). bf16 does only in the
    interpreter: its bf16 tl.dot returns garbage (fp16 is fine), so there the tiles are widened
    first; on a GPU, bf16 tiles go to the tensor cores as they are. The kernels' build decides,
    not the environment at call time.
    """
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and INTERPRETED


def check_blocks(*, minimum: int = 1, **blocks: int) -> None:
    """Tile sizes: powers of two (tl.arange's rule) and, for tl.dot tiles (minimum=16), at least 16
    (what the GPU's MMA needs). The interpreter accepts either mistake, so a bad size would pass
    the CPU tests and fail to compile on the GPU: refused on both."""
    for name, b in blocks.items():
        if b < minimum or b & (b - 1):
            raise ValueError(f"{name}={b}: tile sizes must be powers of two >= {minimum}")


def overlapping(widths: list[int], offsets: list[int]) -> bool:
    """Whether two slices write the same columns of y: then one launch over all slices would have
    two programs read-modify-write the same elements, so the launchers run one slice at a time."""
    spans = sorted((o, o + n) for o, n in zip(offsets, widths) if n > 0)
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


def expand_launches(args):
    """The expand launches of a checked call (`_checks.ExpandArgs`): (slice range, widths, pointer
    table, geometry table, v's rows for those slices) per launch. Slices sharing columns of y run
    one launch each (ordered on the stream: `overlapping`), so no two programs of one launch
    read-modify-write the same elements; slices of width 0 launch nothing."""
    L = len(args.slices)
    groups = [range(i, i + 1) for i in range(L)] if overlapping(args.widths, args.offsets) else [range(L)]
    for g in groups:
        widths = args.widths[g.start:g.stop]
        if max(widths) == 0:
            continue
        ptrs, geo = slice_tables(args.slices[g.start:g.stop], widths, args.offsets[g.start:g.stop])
        yield g, widths, ptrs, geo, args.v[g.start:g.stop]


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


#: Counters a device's first counter buffer holds (65,536 int32: 256 KiB), enough for every launch
#: of the default configurations (a decode attention launch of 2048 sequences x 32 KV heads is the
#: largest); a launch needing more gets a larger buffer (`zeroed_counters`).
MIN_COUNTERS = 1 << 16
#: The counter buffer of each device.
_COUNTERS: dict[torch.device, torch.Tensor] = {}
#: Buffers a larger one replaced, kept alive: a CUDA graph captured earlier may still use them.
_RETIRED_COUNTERS: list[torch.Tensor] = []


def zeroed_counters(device: torch.device, count: int) -> torch.Tensor:
    """The int32 counters of `device` with which a launch finds the last of the programs sharing
    an output tile (split-K matmuls, decode attention's splits, the grouped LoRA shrink): each
    program adds 1 to its tile's counter, the one that sees the last count finishes the tile and
    sets the counter back to 0. At least `count` of them, all 0 between launches.

    One buffer per device for all of these kernels: launches on one stream run one after
    another and each leaves its counters at 0 (launches on two streams at once would need their
    own; the engine runs its steps on one), so no launch zero-fills them and every launch and
    graph replay sees the same pointer. Allocated zeroed at first use (MIN_COUNTERS, more if
    asked); a launch needing more gets a new, larger buffer and the old one is kept alive, never
    freed or shrunk, because a CUDA graph captured earlier keeps launching with its pointer and
    must find it there, at 0. Allocating zero-fills with a launch a graph capture would record
    instead of running, so growing during a capture is refused (RuntimeError): run the shape once
    before capturing it (the decode graphs' warm-up does)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _COUNTERS.get(device)
    if buf is not None and buf.numel() >= count:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"the kernels' counters on {device} must grow to {count} during a CUDA graph capture: "
                           "run this shape once before capturing it")
    if buf is not None:
        _RETIRED_COUNTERS.append(buf)
    buf = _COUNTERS[device] = torch.zeros(max(MIN_COUNTERS, next_pow2(count)), dtype=torch.int32, device=device)
    return buf
