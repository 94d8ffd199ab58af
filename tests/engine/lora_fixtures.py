"""Random PEFT adapters (SmolLM2 or any base shape), written in the real PEFT file format."""
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.lora.peft_format import SMOLLM2_135M_INSTRUCT, parse_adapter_config, tensor_name

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_CANON = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def write_random_adapter(path: Path, rank: int, *, targets=ALL_TARGETS, alpha=None, seed=0,
                         std=0.02, extra_config=None, base=SMOLLM2_135M_INSTRUCT, rank_pattern=None,
                         alpha_pattern=None) -> Path:
    """A random PEFT adapter for `base` (a peft_format.BaseModelShape; default SmolLM2), with
    PEFT's rank_pattern / alpha_pattern if given (each module's tensors at its pattern rank)."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    patterned = parse_adapter_config({"r": rank, "target_modules": list(targets), "rank_pattern": rank_pattern or {}},
                                     num_layers=base.num_layers)
    tensors = {}
    for layer in range(base.num_layers):
        for t in targets:
            fan_in, fan_out = base.module_dims(_CANON[t])
            r = patterned.module_rank(layer, _CANON[t])
            tensors[tensor_name(layer, _CANON[t], "A")] = torch.randn(r, fan_in, generator=g) * std
            tensors[tensor_name(layer, _CANON[t], "B")] = torch.randn(fan_out, r, generator=g) * std
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
           "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
           "base_model_name_or_path": base.name, "task_type": "CAUSAL_LM", "use_rslora": False, "use_dora": False}
    cfg.update({"rank_pattern": rank_pattern or {}, "alpha_pattern": alpha_pattern or {}})
    cfg.update(extra_config or {})
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path
