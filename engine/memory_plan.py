"""Whether a model fits before its weights are read: a model too big for the machine is a
one-line refusal with the numbers (InsufficientMemoryError, a ValueError), not an out-of-memory
kill halfway through loading.

The estimates follow how the engine holds weights (engine.loader, engine.backends):
- host, while loading: the loaders' tensors (a quantized checkpoint's layer matrices as stored,
  a GGUF's other tensors dequantized to fp32, safetensors in their stored dtype: the average is
  engine.loader.read_model_config's bytes a weight), plus what the backend
  keeps on the host: the CPU backend's exact fp32 copy, and for its "auto"/"int8" format an int8
  and a bf16 copy beside it (7 bytes a layer weight in all);
- CUDA: 4-bit layer weights (0.5625 bytes a weight with group scales) or dense ones in the
  activation dtype, the lm_head dense, and room for the KV cache of one full-length sequence.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from engine.config import EngineConfig, ModelConfig

GiB = 1 << 30


class InsufficientMemoryError(ValueError):
    """The model cannot be loaded on this machine; the message gives what it needs and what is free."""


def parameter_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(layer linear weights, embedding and lm_head weights) of `cfg`."""
    per_layer = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size \
        + 3 * cfg.hidden_size * cfg.intermediate_size
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_layers * per_layer, embed


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_bytes_needed(cfg: ModelConfig, ec: EngineConfig, *, source_bytes_per_weight: float) -> int:
    """Host memory the load takes at its peak (see the module docstring)."""
    layers, embed = parameter_counts(cfg)
    loaded = (layers + embed) * source_bytes_per_weight
    if ec.backend == "cpu":
        fmt = ec.weight_format
        kept = layers * (7 if fmt in ("auto", "int8") else 4 if fmt == "fp32" else 6) + embed * 4
        return int(loaded + kept)
    return int(loaded)


def device_bytes_needed(cfg: ModelConfig, ec: EngineConfig) -> int:
    """CUDA memory the weights and one full-length sequence's KV cache take."""
    layers, embed = parameter_counts(cfg)
    itemsize = torch.tensor([], dtype=ec.dtype).element_size()
    per_weight = 0.5625 if ec.weight_format in ("auto", "w4a16") else itemsize
    kv = cfg.kv_bytes_per_token(ec.dtype) * min(ec.max_model_len or cfg.max_position_embeddings,
                                                cfg.max_position_embeddings)
    return int(layers * per_weight + embed * itemsize + kv)


def check_fits(cfg: ModelConfig, ec: EngineConfig, *, source_bytes_per_weight: float,
               host_available: int | None = None, device_free: int | None = None) -> None:
    """InsufficientMemoryError naming the model, what it needs and what is available, where the
    host (or, on CUDA, the device) cannot hold it. TESSERA_SKIP_MEMORY_CHECK=1 skips the check
    (an operator who knows better, e.g. with swap)."""
    if os.environ.get("TESSERA_SKIP_MEMORY_CHECK") == "1":
        return
    layers, embed = parameter_counts(cfg)
    params = f"{(layers + embed) / 1e9:.2f}B weights"
    host = host_available if host_available is not None else host_available_bytes()
    need = host_bytes_needed(cfg, ec, source_bytes_per_weight=source_bytes_per_weight)
    if host is not None and need > host:
        raise InsufficientMemoryError(
            f"model {cfg.name} ({params}) needs about {need / GiB:.1f} GiB of host memory to load on the "
            f"{ec.backend} backend ({ec.weight_format} weights); {host / GiB:.1f} GiB is available "
            "(TESSERA_SKIP_MEMORY_CHECK=1 loads anyway)")
    device = torch.device(ec.device)
    if device.type == "cuda" and (device_free is not None or torch.cuda.is_available()):
        # Without CUDA the backend refuses the device itself, with its own message.
        free = device_free if device_free is not None else torch.cuda.mem_get_info(device)[0]
        need = device_bytes_needed(cfg, ec)
        if need > free:
            raise InsufficientMemoryError(
                f"model {cfg.name} ({params}) needs about {need / GiB:.1f} GiB of {device} memory (weights as "
                f"{ec.weight_format}, one {cfg.max_position_embeddings}-token sequence's KV cache); "
                f"{free / GiB:.1f} GiB is free (a smaller --max-model-len or 4-bit weights need less)")
