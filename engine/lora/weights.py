"""Reading one PEFT LoRA adapter from disk into per-layer A/B tensors for the engine's LoRA slots.

An adapter names the base's checkpoint modules (peft_format.BaseModelShape, built from the
engine's ModelConfig by `base_shape_of`); the engine's slots are the canonical slices q, k, v, o,
gate, up, down. A plain module (q_proj) fills its one slice; a fused one (Phi-3's qkv_proj,
gate_up_proj) fills each of its slices with the module's A and the rows of its B that produce
that slice, so scale * B_slice @ (A @ x) is exactly the slice's rows of scale * B @ (A @ x).
"""
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
    """An adapter in CPU memory, per canonical slice (q, k, v, o, gate, up, down), as loaded (the
    CPU tier holds it as engine.lora.layers.SlotImage, prepared from this):
    `a[(layer, slice)]` [r, in] and `b[(layer, slice)]` [width, r].

    r is the rank of the checkpoint module that holds the slice (config.module_rank); the slices
    of one fused module share its A (the same tensor) and split its B by rows.
    `group_rank[(layer, group)]` is the largest rank of the group's targeted slices in that layer
    (absent: the group is not targeted) and `group_scale[(layer, group)]` the scale the group's
    stack applies; each slice's B already holds the factor slice scale / group_scale, so
    scale * B @ A is exact per slice.

    Loaded as int8 (`quantized`), a and b hold the rows' int8 values and `a_scale` [r] / `b_scale`
    [width] their fp32 scales (punica_kernels.quantize_rows: A = a * a_scale[:, None]), quantized
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
        # Cached: the tensors never change after loading (~420 tensors per adapter).
        # A fused module's slices share one A tensor: counted once.
        tensors = {id(t): t for d in (self.a, self.b, self.a_scale or {}, self.b_scale or {}) for t in d.values()}
        return sum(t.numel() * t.element_size() for t in tensors.values())


def base_shape_of(cfg: ModelConfig) -> BaseModelShape:
    """The served model's self-description for LoRA (peft_format.BaseModelShape): its name,
    architecture, dimensions and LoRA-able checkpoint modules (fused ones where
    cfg.fused_projections), with widths from its heads and head_dim."""
    return BaseModelShape.for_decoder(
        name=cfg.name, architecture=cfg.architecture, num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, fused_projections=cfg.fused_projections)


def load_lora_weights(path: str | Path, version: str, cfg: ModelConfig, *, max_rank: int,
                      dtype: torch.dtype = torch.float32) -> LoRAWeights:
    """Load and check `path`/{adapter_config.json, adapter_model.safetensors} for the base `cfg`
    describes (base_shape_of), stored as `dtype` (a float type, or torch.int8: rows quantized with
    per-row scales), per canonical slice (see LoRAWeights).

    Raises AdapterLoadError naming what is wrong (a module the base does not have, a tensor's
    shape, a rank above `max_rank`, NaN/Inf, ...); nothing is kept on failure.
    """
    path = Path(path)
    base = base_shape_of(cfg)
    for f in path.iterdir() if path.is_dir() else []:
        try:
            check_not_pickle(f.name)
        except UnsupportedAdapterError as e:
            raise AdapterLoadError(str(e)) from None
    try:
        raw = json.loads((path / ADAPTER_CONFIG).read_text())
        config = parse_adapter_config(raw, base)
    except FileNotFoundError:
        raise AdapterLoadError(f"{ADAPTER_CONFIG} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterLoadError(f"{ADAPTER_CONFIG} is not valid JSON: {e}") from None
    except UnsupportedAdapterError as e:
        raise AdapterLoadError(str(e)) from None
    largest, layer, module = config.largest_rank(cfg.num_layers)
    if largest > max_rank:
        where = f"module {config.module_key(layer, module)} has " if config.rank_pattern else "adapter "
        raise AdapterLoadError(f"{where}rank {largest} exceeds this engine's max_lora_rank {max_rank}")
    try:
        tensors = load_file(str(path / ADAPTER_WEIGHTS))
    except FileNotFoundError:
        raise AdapterLoadError(f"{ADAPTER_WEIGHTS} is missing") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise AdapterLoadError(f"{ADAPTER_WEIGHTS} is corrupt: {e}") from None

    expected = expected_tensor_shapes(base, config)
    # Checked one by one, then converted per (module, A/B, shape) with every layer's tensor
    # stacked: one finiteness check and one conversion (or quantization) for 30 tensors instead of
    # one each: per-op torch overhead on hundreds of small tensors would dominate a cold load.
    groups: dict[tuple[str, str, tuple], list[tuple[int, str, torch.Tensor]]] = {}
    for name, shape in expected.items():
        t = tensors.get(name)
        if t is None:
            raise AdapterLoadError(f"tensor {name} is missing")
        if tuple(t.shape) != shape:
            raise AdapterLoadError(f"tensor {name} has shape {tuple(t.shape)}, expected {shape} "
                                   f"({base.module_text(parse_tensor_name(name, base)[1])})")
        if not t.dtype.is_floating_point:
            raise AdapterLoadError(f"tensor {name} has dtype {t.dtype}, expected a float type")
        layer, module, which = parse_tensor_name(name, base)
        groups.setdefault((module, which, tuple(t.shape)), []).append((layer, name, t))
    group_rank, group_scale, fold = _group_ranks_and_scales(config, base)
    a: dict = {}
    b: dict = {}
    scales: dict[str, dict] = {"A": {}, "B": {}}
    for (module, which, _), members in groups.items():
        rows = base.module(module).slice_rows()
        stacked = torch.stack([t.float() for _, _, t in members])
        if which == "B" and any((layer, canon) in fold for layer, _, _ in members for canon, _, _ in rows):
            # One factor per output row: a slice's rows carry its scale relative to its group's.
            factors = torch.ones(stacked.shape[:2], dtype=torch.float32)
            for i, (layer, _, _) in enumerate(members):
                for canon, start, width in rows:
                    factors[i, start:start + width] = fold.get((layer, canon), 1.0)
            stacked = stacked * factors[:, :, None]
        if not torch.isfinite(stacked).all():
            bad = next(name for _, name, t in members if not torch.isfinite(t).all())
            raise AdapterLoadError(f"tensor {bad} has NaN or Inf values")
        row_scales = None
        if dtype == torch.int8:
            stacked, row_scales = quantize_rows(stacked)
        else:
            stacked = stacked.to(dtype)
        for i, (layer, _, _) in enumerate(members):
            whole, whole_scales = stacked[i], (row_scales[i] if row_scales is not None else None)
            for canon, start, width in rows:
                if which == "A":  # every slice of a fused module reads the module's A: one tensor
                    a[(layer, canon)] = whole
                    if whole_scales is not None:
                        scales["A"][(layer, canon)] = whole_scales
                else:  # and its own rows of B
                    b[(layer, canon)] = whole[start:start + width]
                    if whole_scales is not None:
                        scales["B"][(layer, canon)] = whole_scales[start:start + width]
    if dtype == torch.int8:
        return LoRAWeights(version=version, config=config, a=a, b=b, group_rank=group_rank, group_scale=group_scale,
                           a_scale=scales["A"], b_scale=scales["B"])
    return LoRAWeights(version=version, config=config, a=a, b=b, group_rank=group_rank, group_scale=group_scale)


def _group_ranks_and_scales(config: PeftAdapterConfig, base: BaseModelShape):
    """(group_rank, group_scale, fold) of LoRAWeights: per (layer, group) the largest rank of its
    targeted slices (a slice's rank and scale are those of the module that holds it) and the
    scale of the first slice with it; `fold[(layer, slice)]` is the factor slice scale /
    group_scale for each slice where it is not 1."""
    group_rank: dict[tuple[int, str], int] = {}
    group_scale: dict[tuple[int, str], float] = {}
    fold: dict[tuple[int, str], float] = {}
    holder = {canon: m.name for canon, m in base.module_of_slice().items() if m.name in config.target_modules}
    for layer in range(base.num_layers):
        for group, slices in GROUPS.items():
            targeted = [c for c in slices if c in holder]
            if not targeted:
                continue
            ranks = {c: config.module_rank(layer, holder[c]) for c in targeted}
            scales = {c: config.module_scale(layer, holder[c]) for c in targeted}
            top = max(targeted, key=lambda c: ranks[c])  # first of the largest
            group_rank[(layer, group)] = ranks[top]
            group_scale[(layer, group)] = scales[top]
            for c in targeted:
                if scales[c] != scales[top]:
                    fold[(layer, c)] = scales[c] / scales[top]
    return group_rank, group_scale, fold
