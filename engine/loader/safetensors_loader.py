"""Hugging Face Llama checkpoints: config.json + *.safetensors (bf16/fp16/fp32)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.config import ModelConfig


def model_config_from_hf(cfg: dict, name: str) -> ModelConfig:
    if cfg.get("model_type") not in (None, "llama"):
        raise ValueError(f"unsupported model_type {cfg.get('model_type')!r} (only 'llama' is served)")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    rope_theta = cfg.get("rope_theta")
    if rope_theta is None:  # transformers 5 nests it under rope_parameters
        rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return ModelConfig(
        name=name,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rope_theta=float(rope_theta),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def load_safetensors_checkpoint(path: str | Path, name: str | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """Read config.json and every *.safetensors shard of a HF Llama checkpoint directory.

    Returns (config, tensors as stored in HF names, an empty metadata dict).
    """
    path = Path(path)
    cfg = model_config_from_hf(json.loads((path / "config.json").read_text()), name or path.name)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(load_file(str(shard)))
    return cfg, tensors, {}
