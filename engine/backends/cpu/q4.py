"""The hand-written CPU kernel on a GGUF file's own Q4_1 blocks (csrc/q4_1_linear.c), for the
int8 format's smallest batches where the checkpoint is Q4_1: the weights llama.cpp quantized,
exactly, at 0.625 bytes a weight (int8: 1). Built and loaded like the other CPU kernels
(punica_kernels.cbuild); unavailable (no compiler, neither AVX-512 nor AVX2, `EngineConfig.cpu_q4_kernel`
off): the int8 kernels serve.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from punica_kernels import cbuild, cpu_native

SOURCE = Path(__file__).parent / "csrc" / "q4_1_linear.c"
BLOCK_BYTES = 20  # ggml's Q4_1 block: fp16 d, fp16 min, 16 bytes of nibbles (32 weights)


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None (not built, or built without AVX-512 or AVX2)."""
    lib = cbuild.load(SOURCE, None,
                      {"tessera_q4_1_available": (), "tessera_q4_1_linear_f32": ("i64",) * 3 + ("ptr",) * 4,
                       "tessera_q4_1_linear_lora_f32": ("i64",) * 3 + ("ptr",) * 8},
                      returns={"tessera_q4_1_available": "int", "tessera_q4_1_linear_lora_f32": "int"})
    return lib if lib is not None and lib.tessera_q4_1_available() else None


def supports(raw: torch.Tensor) -> bool:
    """Whether the kernel can take these raw Q4_1 rows (uint8 [N, K/32 * 20], N % 16 == 0)."""
    return (raw.dtype == torch.uint8 and raw.dim() == 2 and raw.shape[0] % 16 == 0
            and raw.shape[1] % BLOCK_BYTES == 0 and library() is not None)


def dequantize(raw: torch.Tensor) -> torch.Tensor:
    """Raw Q4_1 rows -> fp32 [N, K] (ggml's order: byte j of a block holds inputs j and j + 16)."""
    n = raw.shape[0]
    blocks = raw.view(n, -1, BLOCK_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    mn = blocks[..., 2:4].contiguous().view(torch.float16).float()
    qs = blocks[..., 4:].long()
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # [N, KB, 32]
    return (q * d + mn).reshape(n, -1)


def block_weight(raw: torch.Tensor) -> torch.Tensor:
    """Raw Q4_1 rows [N, KB * 20] -> the kernel's layout [N/16, KB, 320]: per 16 rows and 32
    inputs, the rows' nibbles (16 x 16 bytes), then their d and their mins (16 fp16 each)."""
    n = raw.shape[0]
    blocks = raw.view(n // 16, 16, -1, BLOCK_BYTES).permute(0, 2, 1, 3)  # [N/16, KB, 16 rows, 20]
    qs = blocks[..., 4:].reshape(*blocks.shape[:2], 256)
    d = blocks[..., 0:2].reshape(*blocks.shape[:2], 32)
    mn = blocks[..., 2:4].reshape(*blocks.shape[:2], 32)
    return torch.cat([qs, d, mn], dim=-1).contiguous()


def q4_linear(x: torch.Tensor, blocked: torch.Tensor, lora=None) -> torch.Tensor:
    """x [M, K] fp32 @ W.T for the Q4_1 weights W [N, K] in `blocked` -> [M, N] fp32; with `lora`
    (the arguments punica_kernels.cpu_native.StepCall.fused gave for x), plus that LoRA term, in
    the same kernel call."""
    x = x.contiguous()
    m, k = x.shape
    n = blocked.shape[0] * 16
    y = torch.empty(m, n, dtype=torch.float32)
    xsum = torch.empty(m, k // 32, dtype=torch.float32)
    args = (m, k, n, x.data_ptr(), blocked.data_ptr(), y.data_ptr(), xsum.data_ptr())
    if lora is None:
        library().tessera_q4_1_linear_f32(*args)
    elif rc := library().tessera_q4_1_linear_lora_f32(*args, *lora):
        cpu_native.raise_for(rc)
    return y
