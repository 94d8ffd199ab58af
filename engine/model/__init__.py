"""Llama-family model code. Layers never see a Sequence: they get tensors and metadata."""
