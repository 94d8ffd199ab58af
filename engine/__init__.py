"""Tessera inference engine: a quantized Llama-family base model with paged KV cache,
continuous batching and per-request LoRA adapters."""
