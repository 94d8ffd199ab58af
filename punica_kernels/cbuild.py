"""Build a C source of this project with the machine's compiler and load it with ctypes.

Used by the hand-written CPU kernels (punica_kernels.cpu_native, and the engine's CPU backend:
engine.backends.cpu.int8, q4 and decode_ops); one place for how they are built, loaded and given their C signatures.
A library is compiled once per source, flags and CPU (`-march=native`) into a cache directory
and reused by every later process; concurrent builders each write a temporary file and rename
it into place, so a reader never sees half a library.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
#: Headers every kernel may include (`#include "tessera_simd.h"`); part of each library's cache key.
INCLUDE_DIR = Path(__file__).parent / "csrc"


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


def build(source: Path, march: str = "native") -> Path:
    """The compiled library of `source` (built now if not cached) for `-march=<march>` ("native":
    this CPU; tests build "x86-64" to run the plain C paths). Raises RuntimeError without a
    compiler or when compilation fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    src = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(INCLUDE_DIR.glob("*.h")))
    flags = (*FLAGS, f"-march={march}")
    key = hashlib.sha256(src + " ".join(flags).encode() + _cpu_id().encode() + cc.encode()).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, f"-I{INCLUDE_DIR}", "-o", tmp, str(source), "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {source.name}: {proc.stderr.strip()[:500]}")
        os.replace(tmp, out)  # atomic: concurrent builders all end with one complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


#: Argument type names of the kernels' C signatures (`load`'s `signatures`).
C_TYPES = {"i64": ctypes.c_int64, "int": ctypes.c_int, "f32": ctypes.c_float, "ptr": ctypes.c_void_p}


def load(source: Path, switch: str | None, signatures: dict[str, tuple[str, ...]] | None = None,
         returns: dict[str, str] | None = None, march: str = "native") -> ctypes.CDLL | None:
    """The loaded library of `source`, or None when the environment variable `switch` (if named)
    is "0" or the library cannot be built (logged once per caller; callers cache the answer). Load it after
    torch: its OpenMP runtime (same soname) then serves both, one thread pool.

    signatures: {function: argument type names (C_TYPES)}; returns: {function: return type name},
    functions not named there return nothing."""
    if switch and os.environ.get(switch, "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(build(source, march)))
    except (OSError, RuntimeError) as e:
        log.warning("%s unavailable, using the torch path: %s", source.name, e)
        return None
    for name, args in (signatures or {}).items():
        fn = getattr(lib, name)
        fn.argtypes = [C_TYPES[a] for a in args]
        fn.restype = C_TYPES[(returns or {})[name]] if name in (returns or {}) else None
    return lib
