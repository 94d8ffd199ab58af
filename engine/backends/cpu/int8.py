"""The hand-written CPU kernels for the int8 format's decode batches: csrc/int8_linear.c (AVX-512
or AVX2 FMAs; the format rules (formats.py) give it up to 1 row with AMX, 32 on AVX2 alone),
csrc/int8_amx.c for wider ones on CPUs with AMX (int8 tiles widened to bf16 on the tile unit).

Built and loaded like the CPU LoRA kernel (punica_kernels.cbuild: the machine's compiler,
-march=native, a cache keyed by source and CPU). It reads int8 weights in a blocked layout
(`block_weight`) at about twice the rate of torch's `_weight_int8pack_mm` at 1-2 rows, with fp32
activations. Where it is unavailable (no compiler, `EngineConfig.cpu_int8_kernel` off) or the shape is
not a multiple of 16, the int8 format keeps torch's kernel (engine.backends.cpu.linear.Int8TorchLinear).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from punica_kernels import cbuild, cpu_native

SOURCE = Path(__file__).parent / "csrc" / "int8_linear.c"
AMX_SOURCE = Path(__file__).parent / "csrc" / "int8_amx.c"


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (it could not be built)."""
    return cbuild.load(SOURCE, None,
                       {"tessera_int8_linear_f32": ("i64",) * 3 + ("ptr",) * 4,
                        "tessera_int8_linear_lora_f32": ("i64",) * 3 + ("ptr",) * 8},
                       returns={"tessera_int8_linear_lora_f32": "int"})


def supports(weight: torch.Tensor) -> bool:
    """Whether the kernel can take this int8 [N, K] CPU weight (built here, N and K multiples of 16)."""
    n, k = weight.shape
    return weight.device.type == "cpu" and n % 16 == 0 and k % 16 == 0 and library() is not None


def block_weight(weight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the kernel's layout [N/16, K/16, 16, 16]: each 16 output rows x 16 inputs
    contiguous, so a block of rows is one linear stream."""
    n, k = weight.shape
    return weight.view(n // 16, 16, k // 16, 16).permute(0, 2, 1, 3).contiguous()


def int8_linear(x: torch.Tensor, blocked: torch.Tensor, scales: torch.Tensor, lora=None) -> torch.Tensor:
    """x [M, K] fp32 @ (blocked int8 weight * scales).T -> [M, N] fp32 (scales [N] fp32); with
    `lora` (the arguments punica_kernels.cpu_native.StepCall.fused gave for x), plus that LoRA
    term, in the same kernel call."""
    x = x.contiguous()
    m, k = x.shape
    n = scales.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    args = (m, k, n, x.data_ptr(), blocked.data_ptr(), scales.data_ptr(), y.data_ptr())
    if lora is None:
        library().tessera_int8_linear_f32(*args)
    elif rc := library().tessera_int8_linear_lora_f32(*args, *lora):
        cpu_native.raise_for(rc)
    return y


@functools.lru_cache(maxsize=1)
def amx_library() -> ctypes.CDLL | None:
    """The AMX kernel, or None: not built, built for a CPU without AMX, or the OS refused the tile
    state."""
    lib = cbuild.load(AMX_SOURCE, None,
                      {"tessera_amx_init": (), "tessera_int8_linear_amx": ("i64",) * 3 + ("ptr",) * 5,
                       "tessera_int8_linear_amx_lora": ("i64",) * 3 + ("ptr",) * 9},
                      returns={"tessera_amx_init": "int", "tessera_int8_linear_amx_lora": "int"})
    return lib if lib is not None and lib.tessera_amx_init() == 0 else None


def supports_amx(weight: torch.Tensor) -> bool:
    """Whether the AMX kernel can take this int8 [N, K] CPU weight (N % 16 == 0, K % 32 == 0)."""
    n, k = weight.shape
    return weight.device.type == "cpu" and n % 16 == 0 and k % 32 == 0 and amx_library() is not None


def tile_weight(weight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the AMX kernel's layout [N/16, K/32, 16, 16, 2]: for each 16 outputs x 32
    inputs, input pairs (2i, 2i+1) of each output side by side (the tile unit's B layout)."""
    n, k = weight.shape
    return weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def int8_linear_amx(x: torch.Tensor, tiled: torch.Tensor, scales: torch.Tensor, lora=None) -> torch.Tensor:
    """bf16(x [M, K] fp32) @ (tiled int8 weight * scales).T, accumulated in fp32 -> [M, N] fp32;
    with `lora` (as int8_linear's), plus that LoRA term, in the same kernel call."""
    x = x.contiguous()
    m, k = x.shape
    n = scales.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    scratch = torch.empty(-(-m // 16) * 16, k, dtype=torch.int16)  # x as bf16, rows padded to 16
    args = (m, k, n, x.data_ptr(), tiled.data_ptr(), scales.data_ptr(), y.data_ptr(), scratch.data_ptr())
    if lora is None:
        amx_library().tessera_int8_linear_amx(*args)
    elif rc := amx_library().tessera_int8_linear_amx_lora(*args, *lora):
        cpu_native.raise_for(rc)
    return y
