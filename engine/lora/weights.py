"""Reading one PEFT LoRA adapter from disk into per-layer, per-module A/B tensors."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from engine.config import ModelConfig
from engine.lora.peft_format import (
    BaseModelShape,
    PeftAdapterConfig,
    UnsupportedAdapterError,
    check_not_pickle,
    expected_tensor_shapes,
    module_key,
    parse_adapter_config,
    parse_tensor_name,
)
from engine.lora.source import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from punica_kernels import quantize_rows


# The fused groups of the engine's LoRA layers: one punica stack (one rank and scale per slot) each.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q", "k", "v"),
    "o": ("o",),
    "gate_up": ("gate", "up"),
    "down": ("down",),
}


class AdapterLoadError(ValueError):
    """The adapter's files are missing, corrupt, or do not fit the base model."""


@dataclass
class LoRAWeights:
    """An adapter in CPU memory: `a[(layer, module)]` [r, in] and `b[(layer, module)]` [out, r].

    r is the module's own rank (config.module_rank). `group_rank[(layer, group)]` is the largest
    rank of the group's targeted modules in that layer (absent: the group is not targeted) and
    `group_scale[(layer, group)]` the scale the group's stack applies; each module's B already
    holds the factor module_scale / group_scale, so scale * B @ A is exact per module.

    Loaded as int8 (`quantized`), a and b hold the rows' int8 values and `a_scale` [r] / `b_scale`
    [out] their fp32 scales (punica_kernels.quantize_rows: A = a * a_scale[:, None]), quantized
    after that folding."""

    version: str
    config: PeftAdapterConfig
    a: dict[tuple[int, str], torch.Tensor]
    b: dict[tuple[int, str], torch.Tensor]
    group_rank: dict[tuple[int, str], int]
    group_scale: dict[tuple[int, str], float]
    a_scale: dict[tuple[int, str], torch.Tensor] | None = None
    b_scale: dict[tuple[int, str], torch.Tensor] | None = None

    @property
    def quantized(self) -> bool:
        return self.a_scale is not None

    @property
    def rank(self) -> int:
        """The adapter's largest module rank."""
        return max(self.group_rank.values(), default=0)

    @cached_property
    def nbytes(self) -> int:
        # Cached: the tensors never change after loading, and the manager sums this over its
        # whole CPU tier whenever a request releases an adapter (~420 tensors per adapter).
        return sum(t.numel() * t.element_size() for d in (self.a, self.b, self.a_scale or {}, self.b_scale or {})
                   for t in d.values())


def base_shape_of(cfg: ModelConfig) -> BaseModelShape:
    return BaseModelShape(name=cfg.name, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                          num_layers=cfg.num_layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                          head_dim=cfg.head_dim)


def load_lora_weights(path: str | Path, version: str, cfg: ModelConfig, *, max_rank: int,
                      dtype: torch.dtype = torch.float32) -> LoRAWeights:
    """Load and check `path`/{adapter_config.json, adapter_model.safetensors}, stored as `dtype`
    (a float type, or torch.int8: rows quantized with per-row scales).

    Raises AdapterLoadError (or its subclass-compatible UnsupportedAdapterError message) naming
    what is wrong; nothing is kept on failure.
    """
    path = Path(path)
    for f in path.iterdir() if path.is_dir() else []:
        try:
            check_not_pickle(f.name)
        except UnsupportedAdapterError as e:
            raise AdapterLoadError(str(e)) from None
    try:
        raw = json.loads((path / ADAPTER_CONFIG).read_text())
        config = parse_adapter_config(raw, num_layers=cfg.num_layers)
    except FileNotFoundError:
        raise AdapterLoadError(f"{ADAPTER_CONFIG} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterLoadError(f"{ADAPTER_CONFIG} is not valid JSON: {e}") from None
    except UnsupportedAdapterError as e:
        raise AdapterLoadError(str(e)) from None
    largest, layer, module = config.largest_rank(cfg.num_layers)
    if largest > max_rank:
        where = f"module {module_key(layer, module)} has " if config.rank_pattern else "adapter "
        raise AdapterLoadError(f"{where}rank {largest} exceeds this engine's max_lora_rank {max_rank}")
    try:
        tensors = load_file(str(path / ADAPTER_WEIGHTS))
    except FileNotFoundError:
        raise AdapterLoadError(f"{ADAPTER_WEIGHTS} is missing") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise AdapterLoadError(f"{ADAPTER_WEIGHTS} is corrupt: {e}") from None

    expected = expected_tensor_shapes(base_shape_of(cfg), config)
    # Checked one by one, then converted per (module, A/B) with every layer's tensor stacked: one
    # finiteness check and one conversion (or quantization) for 30 tensors instead of one each:
    # per-op torch overhead on hundreds of small tensors would dominate a cold load.
    groups: dict[tuple[str, str], list[tuple[int, str, torch.Tensor]]] = {}
    for name, shape in expected.items():
        t = tensors.get(name)
        if t is None:
            raise AdapterLoadError(f"tensor {name} is missing")
        if config.fan_in_fan_out:
            t = t.T
        if tuple(t.shape) != shape:
            raise AdapterLoadError(f"tensor {name} has shape {tuple(t.shape)}, expected {shape}")
        if not t.dtype.is_floating_point:
            raise AdapterLoadError(f"tensor {name} has dtype {t.dtype}, expected a float type")
        layer, module, which = parse_tensor_name(name)
        groups.setdefault((module, which, tuple(t.shape)), []).append((layer, name, t))
    group_rank, group_scale, fold = _group_ranks_and_scales(config, cfg.num_layers)
    a: dict = {}
    b: dict = {}
    scales: dict[str, dict] = {"A": {}, "B": {}}
    for (module, which, _), members in groups.items():
        stacked = torch.stack([t.float() for _, _, t in members])
        if which == "B" and any((layer, module) in fold for layer, _, _ in members):
            factors = torch.tensor([fold.get((layer, module), 1.0) for layer, _, _ in members], dtype=torch.float32)
            stacked = stacked * factors[:, None, None]
        if not torch.isfinite(stacked).all():
            bad = next(name for _, name, t in members if not torch.isfinite(t).all())
            raise AdapterLoadError(f"tensor {bad} has NaN or Inf values")
        if dtype == torch.int8:
            stacked, row_scales = quantize_rows(stacked)
            for i, (layer, _, _) in enumerate(members):
                scales[which][(layer, module)] = row_scales[i]
        else:
            stacked = stacked.to(dtype)
        for i, (layer, _, _) in enumerate(members):
            (a if which == "A" else b)[(layer, module)] = stacked[i]
    if dtype == torch.int8:
        return LoRAWeights(version=version, config=config, a=a, b=b, group_rank=group_rank, group_scale=group_scale,
                           a_scale=scales["A"], b_scale=scales["B"])
    return LoRAWeights(version=version, config=config, a=a, b=b, group_rank=group_rank, group_scale=group_scale)


def _group_ranks_and_scales(config: PeftAdapterConfig, num_layers: int):
    """(group_rank, group_scale, fold) of LoRAWeights: per (layer, group) the largest targeted
    module rank and the scale of the first module with it; `fold[(layer, module)]` is the factor
    module_scale / group_scale for each module where it is not 1."""
    group_rank: dict[tuple[int, str], int] = {}
    group_scale: dict[tuple[int, str], float] = {}
    fold: dict[tuple[int, str], float] = {}
    for layer in range(num_layers):
        for group, mods in GROUPS.items():
            targeted = [m for m in mods if m in config.target_modules]
            if not targeted:
                continue
            ranks = {m: config.module_rank(layer, m) for m in targeted}
            scales = {m: config.module_scale(layer, m) for m in targeted}
            top = max(targeted, key=lambda m: ranks[m])  # first of the largest
            group_rank[(layer, group)] = ranks[top]
            group_scale[(layer, group)] = scales[top]
            for m in targeted:
                if scales[m] != scales[top]:
                    fold[(layer, m)] = scales[m] / scales[top]
    return group_rank, group_scale, fold
