"""Helpers for the adapter_registry tests: real PEFT adapter files, good and malformed."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.lora.peft_format import BaseModelShape, expected_tensor_shapes, parse_adapter_config
from tests.engine.lora_fixtures import SMOLLM2, decoder_shape

#: Small bases of other families, as their engines describe them: Qwen2's k/v narrower than q
#: (2 KV heads of 8), Gemma's head_dim (32) other than hidden / heads (16), Phi-3's fused
#: qkv_proj and gate_up_proj.
QWEN2 = decoder_shape("Qwen/Qwen2.5-Tiny-Instruct", "qwen2", layers=3, hidden=128, intermediate=352, heads=8,
                      kv_heads=2)
GEMMA = decoder_shape("google/gemma-2-tiny-it", "gemma2", layers=2, hidden=64, intermediate=160, heads=4,
                      kv_heads=2, head_dim=32)
PHI3 = decoder_shape("microsoft/Phi-3-tiny-instruct", "phi3", layers=2, hidden=96, intermediate=128, heads=6,
                     kv_heads=2, fused=True)

HF_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def write_adapter(dest: Path, *, base: BaseModelShape = SMOLLM2, rank: int = 4,
                  modules: tuple[str, ...] = ("q", "v"), dtype: torch.dtype = torch.float16, seed: int = 0,
                  config_overrides: dict | None = None, tensors_hook=None) -> Path:
    """Write a random PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for
    `base` to `dest`. `modules`: short names (q, v, ...: q_proj, v_proj) or the base's own
    module names (qkv_proj). `tensors_hook(dict)` may edit the tensors before saving (to make
    malformed files).
    """
    dest.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base.name,
        "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": [HF_NAMES.get(m, m) for m in modules], "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "fan_in_fan_out": False,
    }
    config.update(config_overrides or {})
    parsed = parse_adapter_config({**config, "r": rank, "target_modules": [HF_NAMES.get(m, m) for m in modules],
                                   "use_dora": False, "modules_to_save": None, "bias": "none",
                                   "peft_type": "LORA", "fan_in_fan_out": False, "layers_to_transform": None,
                                   "rank_pattern": config.get("rank_pattern") or {},
                                   "alpha_pattern": {}}, base)
    g = torch.Generator().manual_seed(seed)
    tensors = {name: (torch.randn(shape, generator=g) * 0.01).to(dtype)
               for name, shape in expected_tensor_shapes(base, parsed).items()}
    if tensors_hook is not None:
        tensors_hook(tensors)
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    return dest
