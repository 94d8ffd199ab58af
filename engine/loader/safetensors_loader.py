"""Hugging Face checkpoints: config.json + *.safetensors (one file, or shards listed by
model.safetensors.index.json), any served family (engine.loader.architectures), bf16/fp16/fp32,
or quantized by AWQ, GPTQ or compressed-tensors (engine.loader.hf_quantized).

Tensors come back in the loaders' one layout (engine.loader): HF Llama names with fused
projections split (Phi-3's qkv_proj into q/k/v_proj, gate_up_proj into gate/up_proj) and norm
weights as applied (Gemma's stored w becomes 1 + w), in the checkpoint's own dtype. A quantized
checkpoint's layer linears come as QuantizedWeight under the same names (`...q_proj.weight`),
converted module by module as read (host memory holds the results and one module's stored
tensors); its dense tensors (embeddings, lm_head, norms, biases) as a dense checkpoint's.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.loader import hf_quantized
from engine.loader.architectures import architecture_of, model_config_from_hf
from engine.loader.quantized import QuantizedWeight

INDEX_FILE = "model.safetensors.index.json"

#: Prefixes a causal LM's decoder tensors may sit under, by how the checkpoint was saved.
_KEEP = ("model.", "lm_head.")


def _is_hub_id(name: str) -> bool:
    """"org/name" or "name": no path prefix, no backslash, at most one slash."""
    return not name.startswith(("/", "~", ".", "\\")) and "\\" not in name and ":" not in name \
        and name.count("/") <= 1


def served_name(cfg: dict, path: Path) -> str:
    """The name a checkpoint directory is served under: config.json's `_name_or_path` when it is
    a hub id (what adapters trained on it name as their base), else the directory's name."""
    hub = cfg.get("_name_or_path")
    if isinstance(hub, str) and hub.strip() and _is_hub_id(hub.strip()):
        return hub.strip()
    return path.resolve().name


def shard_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory: those its index names, else every
    *.safetensors file. FileNotFoundError when there are none or the index names a missing one."""
    index = path / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{path}: {INDEX_FILE} names {missing[0]}, which is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    return files


def _split_rows(t: torch.Tensor | QuantizedWeight, sizes: list[int]) -> list[torch.Tensor | QuantizedWeight]:
    """Consecutive row blocks of a dense or quantized weight, each its own contiguous copy."""
    if isinstance(t, QuantizedWeight):
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [t.rows(a, a + n) for a, n in zip(starts, sizes)]
    return [part.contiguous() for part in t.split(sizes)]


def _split_fused(name: str, t, cfg: ModelConfig) -> list[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Phi-3's fused projections as the split ones (rows q | k | v, gate | up)."""
    if name.endswith("self_attn.qkv_proj.weight"):
        q, k, v = _split_rows(t, [cfg.q_size, cfg.kv_size, cfg.kv_size])
        stem = name.removesuffix("qkv_proj.weight")
        return [(stem + "q_proj.weight", q), (stem + "k_proj.weight", k), (stem + "v_proj.weight", v)]
    if name.endswith("mlp.gate_up_proj.weight"):
        gate, up = _split_rows(t, [cfg.intermediate_size, cfg.intermediate_size])
        stem = name.removesuffix("gate_up_proj.weight")
        return [(stem + "gate_proj.weight", gate), (stem + "up_proj.weight", up)]
    return [(name, t if isinstance(t, QuantizedWeight) else t.contiguous())]


def load_safetensors_checkpoint(path: str | Path, name: str | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """Read config.json and the safetensors shards of a HF checkpoint directory.

    Returns (config, tensors in the loaders' layout, an empty metadata dict); a quantized
    checkpoint's layer linears are QuantizedWeight values in that dict. `name` overrides the
    served name (`served_name`). UnsupportedModelError for a family or feature not served,
    engine.loader.quantized.UnsupportedQuantizationError for a quantization not served.
    """
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    arch = architecture_of(raw.get("model_type", "llama"))
    cfg = model_config_from_hf(raw, name or served_name(raw, path))
    scheme = hf_quantized.quantization_of(raw)
    tensors: dict[str, torch.Tensor | QuantizedWeight] = {}
    with contextlib.ExitStack() as stack:
        # A quantized module's tensors may sit in different shards: every shard stays open
        # (memory-mapped) and each tensor is read when its module is converted.
        file_of = {}
        for shard in shard_files(path):
            f = stack.enter_context(safe_open(str(shard), framework="pt"))
            file_of.update((key, f) for key in f.keys() if key.startswith(_KEEP) and "rotary_emb" not in key)
        quantized = [] if scheme is None else \
            [key.removesuffix("." + scheme.marker) for key in file_of if key.endswith("." + scheme.marker)]
        done = set()
        for module in quantized:
            hf_quantized.check_module(scheme, module)
            names = {part: f"{module}.{part}" for part in scheme.parts if f"{module}.{part}" in file_of}
            weight = scheme.convert(module, {part: file_of[key].get_tensor(key) for part, key in names.items()})
            done.update(names.values())
            for k, part in _split_fused(module + ".weight", weight, cfg):
                tensors[k] = part
        for key, f in file_of.items():
            if key in done:
                continue
            t = f.get_tensor(key)
            if arch.norm_plus_one and key.endswith("norm.weight"):
                t = t.float() + 1.0
            for k, part in _split_fused(key, t, cfg):
                tensors[k] = part
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError(f"{path}: no model.embed_tokens.weight (not a decoder-only causal LM checkpoint)")
    if not cfg.tie_word_embeddings and "lm_head.weight" not in tensors:
        cfg = ModelConfig(**{**cfg.__dict__, "tie_word_embeddings": True})
    return cfg, tensors, {}
