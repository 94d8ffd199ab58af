"""SGMV/BGMV batched-LoRA kernels."""
