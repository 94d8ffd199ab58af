"""Tenants' LoRA adapters: storage, validation, versions, and the engine fetch protocol."""
