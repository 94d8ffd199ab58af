"""Backends: the kernels that run the model, behind one seam (engine.backends.base.Backend).

    backend = create_backend(config)   # EngineConfig.backend: "cpu" | "triton"

`cpu` (engine/backends/cpu): the hand-written C kernels, the embedded default. `triton`
(engine/backends/triton): punica_kernels' Triton LoRA kernels and torch ops, on CUDA (or on CPU
under TRITON_INTERPRET=1). `torch_ops` is the device-neutral reference both fall back to.
"""
from __future__ import annotations

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
