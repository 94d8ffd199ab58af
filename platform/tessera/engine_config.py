"""The engine's configuration from what an operator chooses (settings, CLI flags): one place for
the defaults that follow from the device, so `tessera generate`, `tessera engine-worker` and the
in-process engine of `tessera serve` / `tessera demo` build the same engine from the same choice.

- backend: "cpu" on the CPU, "triton" on CUDA, unless named;
- activations: fp32 on the CPU backend (its measured formats), bf16 on CUDA, fp32 for the
  triton backend on CPU tensors (the interpreter, for tests);
- KV cache: the MiB asked for, else 256 MiB on the CPU and a share of free memory on CUDA;
- device slots (distinct adapters running at once): as many as seats on CUDA, where the Triton
  kernels take any mix of adapters in one batch and fewer slots leave seats empty under many
  tenants' adapters (bench/RESULTS.md "routing"); the engine's 8 on the CPU (embedded use);
- the CPU backend's kernel switches: TESSERA_CPU_*=0 in the environment turns one off.

`engine_config_from_settings` is the same from a PlatformSettings, for the engines the platform
runs (in process, or an engine worker): the sizes an operator sets (slots, seats, CPU tier, KV
cache, the scheduler's big-request fraction), and slots as wide as the highest rank the registry accepts, so every adapter an upload
lets through fits the engine.
"""
from __future__ import annotations

import os


def engine_config(*, device: str = "cpu", backend: str | None = None, kv_cache_mib: int | None = None,
                  threads: int | None = None, environ=os.environ, **overrides):
    """An engine.config.EngineConfig for these choices (`overrides` are EngineConfig fields and
    win over the defaults above). Raises ValueError naming what is wrong."""
    import torch

    from engine.backends import switches_from_env
    from engine.config import EngineConfig

    backend = backend or ("cpu" if device == "cpu" else "triton")
    fields = {"backend": backend, "device": device, "num_threads": threads,
              "dtype": torch.float32 if device == "cpu" else torch.bfloat16,
              "kv_cache_bytes": (kv_cache_mib << 20) if kv_cache_mib is not None
              else (256 << 20 if device == "cpu" else None)}
    fields.update(switches_from_env(backend, environ))
    if device != "cpu":
        fields["max_loras"] = overrides.get("max_num_seqs", EngineConfig.max_num_seqs)
    fields.update(overrides)
    return EngineConfig(**fields)


def engine_config_from_settings(settings, *, device: str | None = None, backend: str | None = None):
    """engine_config for a PlatformSettings; `device`/`backend` (CLI flags) win over its
    engine_device/engine_backend. Unset sizes keep EngineConfig's defaults."""
    sizes = {"max_loras": settings.engine_max_loras, "max_num_seqs": settings.engine_max_num_seqs,
             "lora_cpu_cache_bytes": (settings.engine_lora_cpu_cache_mib << 20)
             if settings.engine_lora_cpu_cache_mib is not None else None}
    return engine_config(device=device or settings.engine_device, backend=backend or settings.engine_backend,
                         kv_cache_mib=settings.engine_kv_cache_mib, threads=settings.engine_threads,
                         enable_prefix_caching=settings.engine_prefix_caching, max_lora_rank=settings.max_rank,
                         big_request_kv_fraction=settings.engine_big_request_kv_fraction,
                         **{k: v for k, v in sizes.items() if v is not None})
