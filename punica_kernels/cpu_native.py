"""The hand-written CPU kernel (csrc/add_lora_cpu.c) for decode-shaped `add_lora` calls.

Built on first use with the machine's C compiler (`cc -O3 -march=native -fopenmp`, ~0.3 s) into
a cache directory keyed by the source, the flags and the CPU's feature flags, and loaded with
ctypes. Where it cannot be built (no compiler) or is switched off (TESSERA_CPU_LORA_KERNEL=0),
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
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "add_lora_cpu.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
#: Longest run of one slot the kernel takes (one pass over its weights); past it (a prefill
#: segment, a popular adapter) the torch path's GEMMs on views win.
MAX_RUN = 8
#: Largest padded rank R the kernel supports (its intermediate lives on the stack).
MAX_RANK = 64


def _cpu_id() -> str:
    """The CPU's model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


def cache_dir() -> Path:
    """TESSERA_KERNEL_CACHE, else _build/ beside this file (a checkout), else ~/.cache/tessera
    (an installed, read-only package)."""
    if os.environ.get("TESSERA_KERNEL_CACHE"):
        return Path(os.environ["TESSERA_KERNEL_CACHE"])
    here = Path(__file__).parent
    if os.access(here, os.W_OK):
        return here / "_build"
    return Path.home() / ".cache" / "tessera" / "kernels"


def _build() -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join(FLAGS).encode() + _cpu_id().encode() + cc.encode()).hexdigest()[:16]
    out = cache_dir() / f"add_lora_cpu-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[:500]}")
        os.replace(tmp, out)  # atomic: concurrent builders all end with one complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (switched off, or it could not be built: logged once)."""
    if os.environ.get("TESSERA_CPU_LORA_KERNEL", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError) as e:
        log.warning("CPU LoRA kernel unavailable, using the torch path: %s", e)
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.tessera_add_lora_f32.argtypes = [i64, i64, i64, i64, p, p, p, p, p, i64, p, p, p, p, p]
    lib.tessera_add_lora_f32.restype = ctypes.c_int
    return lib


def add_lora_f32(args, meta, scales: torch.Tensor, ranks: torch.Tensor) -> bool:
    """Run the fused LoRA term of a checked `add_lora` call (punica_kernels._checks.AddLoRAArgs)
    through the kernel; False (nothing done) when the call is not one it takes: not all fp32,
    a rank stack wider than MAX_RANK, or a run of one adapter slot longer than MAX_RUN (prefill)."""
    x, y = args.x, args.y
    if x.shape[0] == 0 or meta.max_adapter_run() > MAX_RUN:
        return False
    a0 = args.a_slices[0]
    if (x.dtype != torch.float32 or y.dtype != torch.float32 or a0.shape[1] > MAX_RANK
            or any(a.dtype != torch.float32 for a in args.a_slices)
            or any(b.dtype != torch.float32 for b in args.b_slices)):
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
        i64s(*args.widths), i64s(*args.offsets), runs.data_ptr())
    if rc != 0:  # the checks ran before: a rank outside [0, R] here means a bug, not bad input
        raise RuntimeError("CPU LoRA kernel refused its arguments (rank outside the stack)")
    return True
