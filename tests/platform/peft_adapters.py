"""Adapters made the way a team makes them: PEFT on a local checkpoint directory."""
from __future__ import annotations

from pathlib import Path

import torch


def peft_adapter(model_dir: Path, out: Path) -> Path:
    """A LoRA adapter made with PEFT on the checkpoint at `model_dir` (rank 8, every linear, its B
    matrices random so it changes the outputs), saved as PEFT saves it: its
    base_model_name_or_path is the local directory it was loaded from."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    peft_model.save_pretrained(out)
    return out
