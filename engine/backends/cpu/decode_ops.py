"""The decoder's small per-token ops as one C call each on the CPU (csrc/decode_ops.c): RMSNorm,
residual add + RMSNorm, the SwiGLU gate, and decode attention over the paged KV cache (RoPE, the
cache write and attention for every decode token in one call, reading cached rows in place).

Built and loaded like the other CPU kernels (punica_kernels.cbuild). Each wrapper answers None
(or False) where the kernel cannot take the call (not built, not fp32, not on the CPU), and the
caller keeps its torch path (engine.backends.torch_ops), which computes the same result. Whether
they are used at all is `EngineConfig.cpu_decode_ops` (the CPU backend asks).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from punica_kernels import cbuild

SOURCE = Path(__file__).parent / "csrc" / "decode_ops.c"


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (it could not be built)."""
    return cbuild.load(SOURCE, None, {
        "tessera_rms_norm": ("i64", "i64", "ptr", "ptr", "f32", "ptr"),
        "tessera_add_rms_norm": ("i64", "i64", "ptr", "ptr", "ptr", "f32", "ptr"),
        "tessera_silu_mul": ("i64", "i64", "ptr", "ptr"),
        "tessera_decode_attention": ("i64",) * 4 + ("ptr", "i64") + ("ptr",) * 5 + ("i64", "ptr", "f32", "ptr"),
    }, returns={"tessera_decode_attention": "int"})


def _takes(*tensors: torch.Tensor) -> bool:
    return (all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)
            and library() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [M, H] -> x * rsqrt(mean(x^2) + eps) * weight, or None (use the torch path)."""
    if not _takes(x, weight):
        return None
    m, h = x.shape
    out = torch.empty_like(x)
    library().tessera_rms_norm(m, h, x.data_ptr(), weight.data_ptr(), eps, out.data_ptr())
    return out


def add_rms_norm(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x += a (in place, the residual stream), then return rms_norm(x); None (nothing changed)
    where the kernel cannot take it."""
    if not _takes(x, a, weight) or x.shape != a.shape:
        return None
    m, h = x.shape
    out = torch.empty_like(x)
    library().tessera_add_rms_norm(m, h, x.data_ptr(), a.data_ptr(), weight.data_ptr(), eps, out.data_ptr())
    return out


def silu_mul(gu: torch.Tensor) -> torch.Tensor | None:
    """gu [M, 2I] (gate | up) -> silu(gate) * up [M, I], or None."""
    if not _takes(gu):
        return None
    m, two_i = gu.shape
    out = torch.empty(m, two_i // 2, dtype=gu.dtype)
    library().tessera_silu_mul(m, two_i // 2, gu.data_ptr(), out.data_ptr())
    return out


def decode_attention(qkv: torch.Tensor, num_decode: int, num_heads: int, num_kv_heads: int, head_dim: int,
                     cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, lens: torch.Tensor, scale: float, out: torch.Tensor) -> bool:
    """For the first `num_decode` rows of qkv [T, (Hq + 2 Hkv) D] (unrotated q | k | v heads):
    rotate q and k with cos/sin [num_decode, D], write k and v to the caches [slots, Hkv, D] at
    slots[t, lens[t] - 1], and write attention over slots[t, :lens[t]] into out[:num_decode]
    ([T, Hq * D], contiguous). slots: [num_decode, >= max(lens)] int64; lens: [num_decode] int64.
    False (nothing written) where the kernel cannot take the call."""
    if not (_takes(qkv, cos, sin, k_cache, v_cache, out) and slots.dtype == torch.int64 and lens.dtype == torch.int64
            and slots.is_contiguous() and lens.is_contiguous()):
        return False
    return library().tessera_decode_attention(
        num_decode, num_heads, num_kv_heads, head_dim, qkv.data_ptr(), qkv.stride(0), cos.data_ptr(),
        sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), slots.stride(0),
        lens.data_ptr(), scale, out.data_ptr()) == 0
