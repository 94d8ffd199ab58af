"""Backends: the kernels that run the model, behind one seam (engine.backends.base.Backend).

    backend = create_backend(config)   # EngineConfig.backend: "cpu" | "triton"

`cpu` (engine/backends/cpu): the hand-written C kernels, the embedded default. `triton`
(engine/backends/triton): Triton kernels for the LoRA term (punica_kernels' SGMV/BGMV), the
4/8-bit weight matmuls, paged attention with the fused RoPE + KV write, and the norms, plus CUDA
graphs for decode steps, on CUDA (or on CPU under TRITON_INTERPRET=1). `torch_ops` is the
device-neutral reference both fall back to. Backend-neutral pieces of a step: `inputs` (the two
input forms and their upload) and `step_sampling` (host and device sampling, `StepResult`).
Only this package imports `cpu` or `triton` (tests/engine/test_engine_layering.py).
"""
from __future__ import annotations

import os

from engine.backends.base import Backend
from engine.config import EngineConfig


def create_backend(config: EngineConfig) -> Backend:
    """The backend `config.backend` names, for `config.device` (imported only when chosen, so a
    CPU engine never imports triton)."""
    if config.backend == "cpu":
        from engine.backends.cpu import CpuBackend

        return CpuBackend(config)
    if config.backend == "triton":
        from engine.backends.triton import TritonBackend

        return TritonBackend(config)
    raise ValueError(f"unknown backend {config.backend!r}")


def switches_from_env(backend: str, environ=os.environ) -> dict[str, bool]:
    """The EngineConfig kernel switches the environment turns off for `backend` (the CLI edge:
    engine.backends.cpu.SWITCHES for "cpu", none for the others)."""
    if backend != "cpu":
        return {}
    from engine.backends.cpu import switches_from_env as cpu_switches

    return cpu_switches(environ)


def show_choices_on_stderr() -> None:
    """Print the one line each engine this process starts logs about what its backend chose at
    start (the CPU weight formats) on stderr (the CLI commands call it)."""
    from engine.backends.cpu.formats import show_on_stderr

    show_on_stderr()
