"""The hand-written CPU kernel (csrc/add_lora_cpu.c) for decode-shaped `add_lora` calls.

Built on first use with the machine's C compiler (`cc -O3 -march=native -fopenmp`, a few seconds) into
a cache directory keyed by the source, the flags and the CPU's feature flags (punica_kernels.cbuild),
and loaded with ctypes. Where it cannot be built (no compiler) or is switched off (TESSERA_CPU_LORA_KERNEL=0),
`add_lora_f32` answers False and the caller takes the torch path (punica_kernels.cpu), which
computes the same result.

Why: a decode step reads each distinct adapter's matrices once, in short dot products; torch
expresses that as padded batched GEMMs plus gathers and pays per-op overhead for each of the
~120 calls a step makes (bench/RESULTS.md, "punica_kernels"). The kernel walks runs of
consecutive tokens on one slot (the engine orders decodes by slot) and reads their weights once.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import weakref
from pathlib import Path
from typing import NamedTuple

import torch

from . import cbuild

SOURCE = Path(__file__).parent / "csrc" / "add_lora_cpu.c"
#: Longest run of one slot the kernel takes (passes of up to 8 tokens over its weights, hot in
#: L1/L2 after the first); past it (a long prompt) the torch path's GEMMs on views win. Chat-length
#: prompts stay here: on them the kernel spends far less than torch's per-segment matmuls
#: (bench/RESULTS.md).
MAX_RUN = 64
#: Largest padded rank R the kernel supports (its intermediate lives on the stack).
MAX_RANK = 64


def load_library(march: str = "native", source: Path = SOURCE) -> ctypes.CDLL | None:
    """The kernel built for `-march=<march>` and loaded, or None (TESSERA_CPU_LORA_KERNEL=0, or
    it could not be built). Tests load an "x86-64" build to run its plain C paths here;
    bench/lora_kernel_ab.py another revision's `source`."""
    lib = cbuild.load(source, "TESSERA_CPU_LORA_KERNEL", {
        "tessera_add_lora_f32": ("ptr", "i64", "i64") + ("ptr",) * 4,
    }, returns={"tessera_add_lora_f32": "int"}, march=march)
    if lib is not None and getattr(lib, "tessera_lora_step_call", None) is not None:  # earlier sources lack it
        lib.tessera_lora_step_new.argtypes, lib.tessera_lora_step_new.restype = [ctypes.c_int64, ctypes.c_void_p], \
            ctypes.c_void_p
        lib.tessera_lora_step_free.argtypes, lib.tessera_lora_step_free.restype = [ctypes.c_void_p], None
        lib.tessera_lora_step_call.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3
        lib.tessera_lora_step_call.restype = ctypes.c_int
    if lib is not None:
        lib.tessera_hooks = _hooks_address(lib)
    return lib


def _hooks_address(lib: ctypes.CDLL) -> int | None:
    """The address of the build's `tessera_lora_hooks` (csrc/tessera_lora_hooks.h: what a base
    kernel's fused entry calls), or None (an earlier source has none)."""
    try:
        return ctypes.addressof(ctypes.c_char.in_dll(lib, "tessera_lora_hooks"))
    except ValueError:
        return None


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The kernel for this CPU, loaded once (None where it cannot be built or is switched off)."""
    return load_library()


#: The kernel's weight types (its `wtype`).
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


class StackArgs(ctypes.Structure):
    """csrc/add_lora_cpu.c's lora_stack_t: what every call on one stack shares."""

    _fields_ = [("K", ctypes.c_int64), ("R", ctypes.c_int64), ("nslices", ctypes.c_int64), ("wtype", ctypes.c_int64),
                ("scales", ctypes.c_void_p), ("A", ctypes.c_void_p), ("B", ctypes.c_void_p), ("N", ctypes.c_void_p),
                ("off", ctypes.c_void_p), ("A_rs", ctypes.c_void_p), ("B_rs", ctypes.c_void_p)]


#: Per LoRAStack: the kernel's view of it (`kernel_stack`), dropped with the stack.
_STACK_ARGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: Per LoRAMetadata: its longest run of one adapter slot (`max_adapter_run`), dropped with it.
_MAX_RUN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def max_adapter_run(meta) -> int:
    """Longest run of consecutive tokens on one adapter slot (runs of -1 not counted), cached per
    metadata object: the kernel takes decode-shaped fp32 batches by it."""
    run = _MAX_RUN.get(meta)
    if run is None:
        lens = (meta.seg_starts[1:] - meta.seg_starts[:-1])[meta.seg_slots >= 0]
        run = _MAX_RUN[meta] = int(lens.max()) if lens.numel() else 0
    return run


class KernelStack(NamedTuple):
    """A stack as the kernel takes it (`kernel_stack`): its argument struct's address, its weight
    type, and what a call checks its activations against; `keep` holds the struct and its arrays."""

    wtype: int
    address: int
    num_slots: int
    in_features: int
    min_out_width: int
    ranks_ptr: int | None  # None where the ranks are not a contiguous int32 tensor (add_lora's checks serve it)
    keep: tuple


def kernel_stack(stack) -> KernelStack | None:
    """The kernel's view of a `LoRAStack`, built once and kept beside it here (the stacks are
    never reallocated, only written into); None when the stack is not one the kernel takes (mixed
    or other dtypes, rank > MAX_RANK)."""
    if stack not in _STACK_ARGS:
        a0 = stack.a_slices[0]
        weights = stack.a_slices + stack.b_slices
        ok = (a0.device.type == "cpu" and a0.shape[1] <= MAX_RANK and a0.dtype in WEIGHT_TYPES
              and all(w.dtype == a0.dtype for w in weights))
        if not ok:
            _STACK_ARGS[stack] = None
            return None
        n = len(stack.a_slices)
        ptrs, i64s = ctypes.c_void_p * n, ctypes.c_int64 * n

        def pointers(tensors):
            return ptrs(*(t.data_ptr() for t in tensors)) if tensors is not None else None

        arrays = (pointers(stack.a_slices), pointers(stack.b_slices), i64s(*stack.widths), i64s(*stack.offsets),
                  pointers(stack.a_row_scales), pointers(stack.b_row_scales))

        def address(arr):
            return ctypes.addressof(arr) if arr is not None else None

        st = StackArgs(stack.in_features, stack.max_rank, n, WEIGHT_TYPES[a0.dtype], stack.scales.data_ptr(),
                       *(address(arr) for arr in arrays))
        ranks = stack.ranks
        ranks_ptr = ranks.data_ptr() if ranks.dtype == torch.int32 and ranks.is_contiguous() else None
        _STACK_ARGS[stack] = KernelStack(WEIGHT_TYPES[a0.dtype], ctypes.addressof(st), stack.num_slots,
                                         stack.in_features, stack.min_out_width, ranks_ptr, (st, arrays))
    return _STACK_ARGS[stack]


_F32 = torch.float32
_W_F32 = WEIGHT_TYPES[torch.float32]


class StepCall:
    """The kernel bound to one step's LoRAMetadata, for a caller that makes the same kind of call
    on many stacks in a step (the engine's CPU backend: four a layer): the token slots are
    converted once, and each call checks only what keeps the kernel inside its tensors (dtypes,
    contiguity, shapes against the stack and the metadata); the rank values are checked by the
    kernel itself. `for_meta` answers None where the kernel is not built; a call on a stack of
    another slot count than the metadata was checked for answers False."""

    def __init__(self, lib: ctypes.CDLL, meta):
        slots = meta.token_slots if meta.token_slots.dtype == torch.int32 else meta.token_slots.to(torch.int32)
        self._bind(lib, slots, meta.num_slots, max_adapter_run(meta))  # slots checked by build_lora_metadata

    def _bind(self, lib: ctypes.CDLL, slots: torch.Tensor, num_slots: int | None, max_run: int) -> None:
        self.lib = lib
        self.num_tokens = slots.shape[0]
        self.num_slots = num_slots  # the slot values were checked against it
        self.slots = slots  # the step reads it: held as long as the step
        self.slots_ptr = slots.data_ptr()
        self.max_run = max_run
        # The step's run list and scratch, built once for its calls (csrc: lora_step_t), and the
        # entry every call goes through: (stack, step, ldy, x, y, ranks) -> rc. A build of an
        # earlier source (bench/lora_kernel_ab.py's peer) has only the one-call entry, bound to
        # the same arguments.
        self.step = None
        self.hooks = None
        self.entry = getattr(lib, "tessera_lora_step_call", None)
        if self.entry is not None:
            self.hooks = getattr(lib, "tessera_hooks", None)
            self.step = lib.tessera_lora_step_new(self.num_tokens, self.slots_ptr)
            if not self.step:
                raise MemoryError("CPU LoRA kernel: no memory for a step's run list")
            weakref.finalize(self, lib.tessera_lora_step_free, self.step)
        else:
            one_call, n, slots_ptr = lib.tessera_add_lora_f32, self.num_tokens, self.slots_ptr
            self.entry = lambda st, _step, ldy, x, y, ranks: one_call(st, n, ldy, x, y, slots_ptr, ranks)

    @classmethod
    def for_meta(cls, meta) -> StepCall | None:
        lib = library()
        return None if lib is None or meta.token_slots.device.type != "cpu" else cls(lib, meta)

    @classmethod
    def for_slots(cls, token_slots: list[int], num_slots: int, lib: ctypes.CDLL | None = None) -> StepCall | None:
        """The kernel bound to a step given as its token slots (ints in [-1, num_slots); -1: no
        adapter), without building a LoRAMetadata: what a CPU step needs when every call goes to
        the kernel. None where the kernel is not built; ValueError for a slot out of range. `lib`:
        another build of the kernel (load_library) instead of this CPU's."""
        lib = lib or library()
        if lib is None:
            return None
        if token_slots and (min(token_slots) < -1 or max(token_slots) >= num_slots):
            raise ValueError(f"token slots must be in [-1, {num_slots}); got {min(token_slots)}..{max(token_slots)}")
        call = cls.__new__(cls)
        max_run = max((len(list(run)) for s, run in itertools.groupby(token_slots) if s >= 0), default=0)
        call._bind(lib, torch.tensor(token_slots, dtype=torch.int32), num_slots, max_run)
        return call

    def run(self, ks: KernelStack | None, x: torch.Tensor, y: torch.Tensor) -> bool:
        """`__call__` on a stack already resolved with `kernel_stack`, for contiguous activations
        (the engine's): y's rows are its row stride. The fewest accesses to x and y that keep the
        kernel inside them, because the engine makes this call between base-model matmuls that
        have pushed the interpreter's, torch's and ctypes' state out of L2: each object or method
        touched costs misses (bench/RESULTS.md, session 28). False (nothing done) where `__call__`
        or add_lora must serve the call."""
        n = self.num_tokens
        if (ks is None or ks.ranks_ptr is None or ks.num_slots != self.num_slots or n == 0
                or x.dtype is not _F32 or y.dtype is not _F32 or (ks.wtype == _W_F32 and self.max_run > MAX_RUN)):
            return False
        xs, ys = x.shape, y.shape
        if (xs[0] != n or xs[1] != ks.in_features or ys[0] != n or ys[1] < ks.min_out_width
                or not x.is_contiguous() or not y.is_contiguous()):
            return False
        rc = self.entry(ks.address, self.step, ys[1], x.data_ptr(), y.data_ptr(), ks.ranks_ptr)
        if rc:
            raise_for(rc)
        return True

    def fused(self, ks: KernelStack | None, x: torch.Tensor, width: int) -> tuple[int, int, int, int] | None:
        """The LoRA arguments of a base kernel's fused entry (csrc/tessera_lora_hooks.h) that adds
        the term of x on `ks` into the base product's own output [T, width], contiguous:
        (hooks, stack, step, ranks); None where `run` would refuse the call, or this build has no
        hooks (the caller then makes the two calls)."""
        n = self.num_tokens
        if (self.hooks is None or ks is None or ks.ranks_ptr is None or ks.num_slots != self.num_slots or n == 0
                or x.dtype is not _F32 or width < ks.min_out_width or (ks.wtype == _W_F32 and self.max_run > MAX_RUN)):
            return None
        xs = x.shape
        if xs[0] != n or xs[1] != ks.in_features or not x.is_contiguous():
            return None
        return self.hooks, ks.address, self.step, ks.ranks_ptr

    def __call__(self, stack, x: torch.Tensor, y: torch.Tensor) -> bool:
        """y += the adapter term of x on `stack` (punica_kernels.add_lora's contract) through the
        kernel; False (nothing done) where add_lora must serve the call instead. y's rows may lie
        apart (a view of wider rows)."""
        ks = kernel_stack(stack)
        if y.is_contiguous():
            return self.run(ks, x, y)
        n = self.num_tokens
        if ks is None or ks.ranks_ptr is None or ks.num_slots != self.num_slots or n == 0:
            return False
        ys, ystride = y.shape, y.stride()
        if (x.dtype is not _F32 or y.dtype is not _F32 or x.shape != (n, ks.in_features)
                or ys[0] != n or ys[1] < ks.min_out_width or ystride[1] != 1 or not x.is_contiguous()
                or (ks.wtype == _W_F32 and self.max_run > MAX_RUN)):
            return False
        rc = self.entry(ks.address, self.step, ystride[0], x.data_ptr(), y.data_ptr(), ks.ranks_ptr)
        if rc:
            raise_for(rc)
        return True


def raise_for(rc: int) -> None:
    """The exception for a kernel's nonzero return code (its own or a fused entry's)."""
    if rc == -2:
        raise MemoryError("CPU LoRA kernel: no memory for its run list or scratch")
    if rc != 0:  # a rank outside [0, R] here means a bug, not bad input
        raise RuntimeError("CPU LoRA kernel refused its arguments (rank outside the stack)")


def add_lora_f32(args, meta) -> bool:
    """Run the fused LoRA term of a checked `add_lora` call (punica_kernels._checks.AddLoRAArgs:
    its stack holds the weights, scales and ranks) through the kernel; False (nothing done) when
    the call is not one it takes: activations not fp32, stacks not all of one of fp32, bf16 or int8,
    a rank stack wider than MAX_RANK, or (fp32 stacks) a run of one adapter slot longer than
    MAX_RUN. bf16 and int8 stacks take any run length: the torch path would have to widen whole
    stacks per call."""
    x, y = args.x, args.y
    if x.shape[0] == 0 or x.dtype != torch.float32 or y.dtype != torch.float32:
        return False
    ks = kernel_stack(args.stack)
    if ks is None:
        return False
    if ks.wtype == WEIGHT_TYPES[torch.float32] and max_adapter_run(meta) > MAX_RUN:
        return False
    lib = library()
    if lib is None:
        return False
    slots = meta.token_slots if meta.token_slots.dtype == torch.int32 else meta.token_slots.to(torch.int32)
    ranks = args.stack.ranks
    ranks32 = ranks if ranks.dtype == torch.int32 else ranks.to(torch.int32)
    rc = lib.tessera_add_lora_f32(ks.address, x.shape[0], y.stride(0), x.data_ptr(), y.data_ptr(),
                                  slots.data_ptr(), ranks32.data_ptr())
    raise_for(rc)
    return True
