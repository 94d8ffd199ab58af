"""Building blocks of the decoder: RMSNorm, rotary embedding, and base linear weights in the
storage format chosen by measurement (fp32, bf16, or int8 weight-only)."""
from __future__ import annotations

import time

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, H]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op instead of seven: per-op dispatch is a visible share of a decode step.
            return torch.nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Statistics in fp32 whatever the activation dtype, as HF's LlamaRMSNorm does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(self.weight.dtype)).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """HF-layout (rotate-half) RoPE with cos/sin precomputed for every position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, dtype: torch.dtype):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)  # [P, D]
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> (cos, sin) [T, 1, D], computed once per step for every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D] (q and k heads side by side, rotated in one pass) -> rotated x."""
        cos, sin = cos_sin
        return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class BaseLinear(nn.Module):
    """y = x @ W.T for a frozen base weight W [out, in], stored as `fmt`.

    fmt "fp32"/"bf16": a dense weight in that dtype (activations are cast to it).
    fmt "int8": per-output-channel symmetric int8 with bf16 scales, multiplied by torch's fused
    weight-only kernel (`_weight_int8pack_mm`, 1 byte read per weight) for skinny batches
    (M <= int8_max_rows: decode); wider batches use a dense fp32 copy, because that kernel is
    slower than a dense GEMM there. Where the crossover lies depends on the CPU (AVX-512/VNNI or
    only AVX2): `calibrate_int8_rows` measures it on the loaded weights (bench/RESULTS.md).
    The output has the activation dtype.
    """

    INT8_MAX_ROWS = 32

    def __init__(self, weight: torch.Tensor, fmt: str):
        super().__init__()
        self.fmt = fmt
        self.int8_max_rows = self.INT8_MAX_ROWS
        self.out_features, self.in_features = weight.shape
        w = weight.float()
        if fmt == "fp32":
            self.register_buffer("weight", w.contiguous())
        elif fmt == "bf16":
            self.register_buffer("weight", w.to(torch.bfloat16).contiguous())
        elif fmt == "int8":
            scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
            q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            self.register_buffer("weight", q.contiguous())
            self.register_buffer("scales", scale.to(torch.bfloat16))
            self.register_buffer("dense", w.contiguous())
        else:
            raise ValueError(f"unknown weight format {fmt!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] -> [T, out]
        if self.fmt == "int8":
            if x.shape[0] > self.int8_max_rows:
                return torch.nn.functional.linear(x.to(self.dense.dtype), self.dense).to(x.dtype)
            y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scales)
            return y.to(x.dtype)
        if x.dtype != self.weight.dtype:
            return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)
        return torch.nn.functional.linear(x, self.weight)

    def dequantized(self) -> torch.Tensor:
        """The weight as fp32 [out, in] (for references and tests)."""
        if self.fmt == "int8":
            return self.weight.float() * self.scales.float()[:, None]
        return self.weight.float()


def calibrate_int8_rows(layers: list[BaseLinear], candidates=(1, 2, 4, 8, 12, 16, 24, 32), reps: int = 2) -> int:
    """Measure, on these int8 layers' own weights, the largest batch (rows) for which the int8
    kernel beats the dense fp32 copy, and set it as every layer's `int8_max_rows`. Each timing
    runs all the layers in turn, so weights come from memory as in a real step, not from cache.
    Returns the threshold (0: dense is faster even for one row)."""
    if not layers:
        return 0
    best = 0
    with torch.inference_mode():
        for m in candidates:
            xs = {k: torch.randn(m, k) for k in {layer.in_features for layer in layers}}
            xbs = {k: x.to(torch.bfloat16) for k, x in xs.items()}
            times = []
            for dense in (False, True):
                t0 = time.perf_counter()
                for _ in range(reps):
                    for layer in layers:
                        if dense:
                            torch.nn.functional.linear(xs[layer.in_features], layer.dense)
                        else:
                            torch._weight_int8pack_mm(xbs[layer.in_features], layer.weight, layer.scales)
                times.append(time.perf_counter() - t0)
            if times[0] <= times[1]:
                best = m
            else:
                break
    for layer in layers:
        layer.int8_max_rows = best
    return best
