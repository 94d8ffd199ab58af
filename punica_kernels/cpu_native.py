"""The hand-written CPU kernel (csrc/add_lora_cpu.c) for decode-shaped `add_lora` calls.

Built on first use with the machine's C compiler (`cc -O3 -march=native -fopenmp`, ~0.3 s) into
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
from pathlib import Path

import torch

from . import cbuild

SOURCE = Path(__file__).parent / "csrc" / "add_lora_cpu.c"
#: Longest run of one slot the kernel takes (passes of up to 8 tokens over its weights, hot in
#: L1/L2 after the first); past it (a long prompt) the torch path's GEMMs on views win. Chat-length
#: prompts stay here: 32 prompts of ~35 tokens on 32 adapters spent 0.97 s of LoRA work in torch's
#: per-segment matmuls and 0.28 s in the kernel (bench/RESULTS.md); isolated, warm, a 512-token
#: run is ~1.3x faster as one GEMM.
MAX_RUN = 64
#: Largest padded rank R the kernel supports (its intermediate lives on the stack).
MAX_RANK = 64


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (TESSERA_CPU_LORA_KERNEL=0, or it could not be built)."""
    return cbuild.load(SOURCE, "TESSERA_CPU_LORA_KERNEL", {
        "tessera_add_lora_f32": ("i64",) * 4 + ("ptr",) * 5 + ("i64",) + ("ptr",) * 5 + ("int",),
    }, returns={"tessera_add_lora_f32": "int"})


def add_lora_f32(args, meta, scales: torch.Tensor, ranks: torch.Tensor) -> bool:
    """Run the fused LoRA term of a checked `add_lora` call (punica_kernels._checks.AddLoRAArgs)
    through the kernel; False (nothing done) when the call is not one it takes: activations not
    fp32, stacks neither all fp32 nor all bf16, a rank stack wider than MAX_RANK, or (fp32 stacks)
    a run of one adapter slot longer than MAX_RUN. bf16 stacks take any run length: the torch path
    would have to widen whole stacks per call."""
    x, y = args.x, args.y
    if x.shape[0] == 0:
        return False
    a0 = args.a_slices[0]
    weights = args.a_slices + args.b_slices
    bf16 = a0.dtype == torch.bfloat16
    if (x.dtype != torch.float32 or y.dtype != torch.float32 or a0.shape[1] > MAX_RANK
            or a0.dtype not in (torch.float32, torch.bfloat16) or any(w.dtype != a0.dtype for w in weights)
            or (not bf16 and meta.max_adapter_run() > MAX_RUN)):
        return False
    lib = library()
    if lib is None:
        return False
    n = len(args.a_slices)
    slots = meta.token_slots if meta.token_slots.dtype == torch.int32 else meta.token_slots.to(torch.int32)
    ranks64 = ranks if ranks.dtype == torch.int64 else ranks.to(torch.int64)
    ptrs = (ctypes.c_void_p * n)
    i64s = (ctypes.c_int64 * n)
    runs = torch.empty(3 * x.shape[0], dtype=torch.int64)
    rc = lib.tessera_add_lora_f32(
        x.shape[0], x.shape[1], a0.shape[1], y.stride(0), x.data_ptr(), y.data_ptr(), slots.data_ptr(),
        ranks64.data_ptr(), scales.data_ptr(), n,
        ptrs(*(a.data_ptr() for a in args.a_slices)), ptrs(*(b.data_ptr() for b in args.b_slices)),
        i64s(*args.widths), i64s(*args.offsets), runs.data_ptr(), int(bf16))
    if rc != 0:  # the checks ran before: a rank outside [0, R] here means a bug, not bad input
        raise RuntimeError("CPU LoRA kernel refused its arguments (rank outside the stack)")
    return True
