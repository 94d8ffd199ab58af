"""The engine's configuration from what an operator chooses (settings, CLI flags): one place for
the defaults that follow from the device, so `tessera generate`, `tessera engine-worker` and the
in-process engine of `tessera serve` / `tessera demo` build the same engine from the same choice.

- backend: "cpu" on the CPU, "triton" on CUDA, unless named;
- activations: fp32 on the CPU backend (its measured formats), bf16 on CUDA, fp32 for the
  triton backend on CPU tensors (the interpreter, for tests);
- KV cache: the MiB asked for, else 256 MiB on the CPU and a share of free memory on CUDA;
- the CPU backend's kernel switches: TESSERA_CPU_*=0 in the environment turns one off.
"""
from __future__ import annotations

import os


def engine_config(*, device: str = "cpu", backend: str | None = None, kv_cache_mib: int | None = None,
                  threads: int | None = None, environ=os.environ, **overrides):
    """An engine.config.EngineConfig for these choices (`overrides` are EngineConfig fields and
    win over the defaults above). Raises ValueError naming what is wrong."""
    import torch

    from engine.backends.cpu import switches_from_env
    from engine.config import EngineConfig

    backend = backend or ("cpu" if device == "cpu" else "triton")
    fields = {"backend": backend, "device": device, "num_threads": threads,
              "dtype": torch.float32 if device == "cpu" else torch.bfloat16,
              "kv_cache_bytes": (kv_cache_mib << 20) if kv_cache_mib is not None
              else (256 << 20 if device == "cpu" else None)}
    if backend == "cpu":
        fields.update(switches_from_env(environ))
    fields.update(overrides)
    return EngineConfig(**fields)
