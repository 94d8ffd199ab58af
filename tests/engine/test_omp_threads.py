"""engine.omp_threads: only the step's thread keeps an OpenMP pool. Helper threads that run torch
ops (the adapter loaders) run them on themselves, and a thread done with parallel work lets its
workers go, so the process's OpenMP workers never outnumber the CPUs (past that, libgomp stops
letting idle workers spin and every parallel region of a step waits for a wake-up)."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from engine import omp_threads

pytestmark = pytest.mark.skipif(omp_threads._libgomp() is None or torch.get_num_threads() < 2,
                                reason="needs torch on libgomp with 2+ threads")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_op() -> None:
    torch.randn(1 << 20).mul_(2.0).sum()  # large enough for ATen to open a parallel region


def _in_thread(fn):
    """fn() in a new thread, which stays alive until fn returns; fn's result."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()))
    t.start()
    t.join()
    return out["r"]


def test_a_thread_that_runs_parallel_ops_gets_workers_and_release_lets_them_go():
    def body():
        before = _threads()
        _parallel_op()
        with_pool = _threads()
        omp_threads.release_pool()
        return before, with_pool, _threads()

    before, with_pool, after = _in_thread(body)
    assert with_pool == before + torch.get_num_threads() - 1  # this thread's own pool
    assert after == before


def test_a_serial_thread_runs_torch_ops_on_itself():
    def body():
        omp_threads.serial_thread()
        before = _threads()
        _parallel_op()
        return omp_threads.max_threads(), before, _threads()

    n, before, after = _in_thread(body)
    assert n == 1 and after == before
    assert omp_threads.max_threads() == torch.get_num_threads()  # other threads keep theirs
