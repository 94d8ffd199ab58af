"""LoRA adapters in the engine: PEFT format, fetch protocol, tiered manager, LoRA-aware layers."""
