"""One host thread runs multi-threaded OpenMP regions: the step's.

torch's CPU kernels, oneDNN and the CPU LoRA kernel share the OpenMP runtime torch loaded
(libgomp). libgomp gives every host thread that opens a parallel region its own pool of worker
threads, kept until that host thread exits, and once the workers of all pools outnumber the CPUs
it stops letting idle workers spin: they sleep at once, and every parallel region after that
waits for a worker to be woken (tens of microseconds in a VM, for each of the thousands of
regions of a decode step). A process that builds its engine in one thread and steps it in
another, or whose adapter-loading threads run torch ops, gets there with two CPUs: a 32-adapter
decode step on a 2-core VM took 73 ms with the loader threads' pools alive and 58 ms without
(bench/RESULTS.md). So:
- `serial_thread()` in a helper thread (the adapter loaders): its torch ops run on that thread
  alone, so it never gets a pool;
- `release_pool()` in a thread that is done with parallel work (the thread that built an engine
  another thread steps): its pool's workers exit.

Both do nothing where torch's OpenMP runtime is not libgomp (or not loaded): the effect is on
speed only, never on results.
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch

log = logging.getLogger(__name__)

#: OpenMP 5.0's omp_pause_soft: the runtime may release a thread's pool (libgomp: the calling
#: thread's workers exit).
_OMP_PAUSE_SOFT = 1


@functools.lru_cache(maxsize=1)
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp torch loaded (found by its soname among the loaded libraries), or None where
    torch's parallel backend is not OpenMP or the library lacks the calls used here."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=ctypes.RTLD_GLOBAL | getattr(ctypes, "RTLD_NOLOAD", 0))
        lib.omp_set_num_threads.argtypes = [ctypes.c_int]
        lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
        lib.omp_pause_resource_all.restype = ctypes.c_int
        lib.omp_get_max_threads.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return lib


def serial_thread() -> None:
    """Make torch's parallel ops in the calling thread run on it alone (no OpenMP pool for it).
    torch sets each new thread's OpenMP thread count at its first parallel op, so one runs first."""
    lib = _libgomp()
    if lib is None:
        return
    torch.zeros(2).add_(1)  # ATen's per-thread init of the OpenMP thread count
    lib.omp_set_num_threads(1)


def release_pool() -> None:
    """Let the calling thread's OpenMP workers exit (a later parallel op there starts new ones)."""
    lib = _libgomp()
    if lib is not None and lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) != 0:
        log.debug("OpenMP kept this thread's pool (omp_pause_resource_all refused)")


def max_threads() -> int | None:
    """The calling thread's OpenMP thread count (None without libgomp): for tests."""
    lib = _libgomp()
    return None if lib is None else lib.omp_get_max_threads()
