"""The CPU backend's base linear: frozen weights stored as fp32, bf16 or int8 weight-only, each
batch on the copy the CPU's rules choose for its width (engine.backends.cpu.formats)."""
from __future__ import annotations

import functools

import torch
from torch import nn

from engine.backends.cpu import int8 as cpu_int8
from engine.backends.cpu import q4 as cpu_q4


class CpuLinear(nn.Module):
    """y = x @ W.T for a frozen base weight W [out, in], stored as `fmt`.

    fmt "fp32"/"bf16": a dense weight in that dtype (activations are cast to it).
    fmt "int8": per-output-channel symmetric int8 with bf16 scales, read 1 byte per weight for
    skinny batches (M <= int8_max_rows) by `int8_linear`: the C kernel on a blocked copy
    (`pack_int8`, fp32 activations, each block of rows one linear stream) or torch's fused weight-only
    kernel (`_weight_int8pack_mm`, bf16 activations); wider batches use a dense copy, because a
    dense GEMM beats those there:
      - `dense` (fp32) for `exact=True` calls, which the model makes for steps that prefill:
        a prompt's first token comes from (near) fp32 numerics, as with the exact format;
      - `dense_fast` (bf16, or None = use `dense`) for decode-only steps wider than the int8
        crossover: bf16 GEMMs beat fp32 where the CPU has avx512_bf16 and lose to it where it has
        only AVX2, so bf16 is kept only on CPUs with avx512_bf16 or AMX.
    Both the crossover and the fast dtype depend on the CPU: the backend sets them at engine
    start by the rules of engine.backends.cpu.formats (the same on every start, whatever the load).
    `pack_dense` (CPU with oneDNN) adds oneDNN-blocked copies of those dense weights, which
    `dense_linear` then uses: the same dtype and numerics, without the per-call reorder of a
    plain weight (faster at 1-100 rows; bench/RESULTS.md).
    The output has the activation dtype.
    """

    INT8_MAX_ROWS = 32

    def __init__(self, weight: torch.Tensor, fmt: str, q4_1: torch.Tensor | None = None):
        """weight: fp32-convertible [out, in]; q4_1: the checkpoint's raw Q4_1 rows of the same
        weight where it has them (kept for the int8 format's smallest batches, see pack_int8)."""
        super().__init__()
        self.fmt = fmt
        self.q4_1_raw = q4_1 if fmt == "int8" else None
        self.q4_blocked: torch.Tensor | None = None  # the Q4_1 kernel's layout of q4_1_raw (pack_int8)
        self.q4_max_rows = 1  # batches up to this many rows take the Q4_1 kernel (formats)
        self.int8_max_rows = self.INT8_MAX_ROWS
        self.out_features, self.in_features = weight.shape
        self.dense_fast: torch.Tensor | None = None
        self.packed: dict[torch.dtype, torch.Tensor] = {}  # oneDNN-blocked dense copies (pack_dense)
        self.int8_blocked: torch.Tensor | None = None  # the C kernel's layout of `weight` (pack_int8)
        self.int8_scales: torch.Tensor | None = None   # fp32 copy of `scales` for it
        self.int8_tiled: torch.Tensor | None = None    # the AMX kernel's layout of `weight` (pack_int8)
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

    def set_fast_dtype(self, dtype: torch.dtype) -> None:
        """Decode-only wide batches of an int8 layer multiply by the dense weight in `dtype`
        (fp32: the exact copy itself; bf16: a second, rounded copy)."""
        if self.fmt != "int8":
            raise ValueError("only int8 layers keep dense copies")
        self.dense_fast = None if dtype == torch.float32 else self.dense.to(dtype).contiguous()

    def pack_dense(self) -> bool:
        """Add oneDNN-blocked copies of the int8 format's dense weights (fp32 `dense`, and
        `dense_fast` if set) for `dense_linear`. False (nothing packed) where oneDNN packing is
        unavailable (not a CPU tensor, or a torch build without it)."""
        if self.fmt != "int8" or not _onednn_packing():
            return False
        self.packed = {w.dtype: torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS)
                       for w in (self.dense, self.dense_fast) if w is not None}
        return True

    def pack_int8(self, *, q4: bool = True, amx: bool = True) -> bool:
        """Add the CPU int8 kernel's blocked copy of the int8 weight (engine.backends.cpu.int8) for
        `int8_linear`, on CPUs with AMX the tiled copy for `wide_linear` (if `amx`), and the Q4_1
        kernel's copy of the checkpoint's blocks (if `q4`). False (nothing added) where the
        kernel cannot take it."""
        if self.fmt != "int8" or not cpu_int8.supports(self.weight):
            return False
        self.int8_blocked = cpu_int8.block_weight(self.weight)
        self.int8_scales = self.scales.float()
        if amx and cpu_int8.supports_amx(self.weight):
            self.int8_tiled = cpu_int8.tile_weight(self.weight)
        if q4 and self.q4_1_raw is not None and cpu_q4.supports(self.q4_1_raw):
            self.q4_blocked = cpu_q4.block_weight(self.q4_1_raw)
        self.q4_1_raw = None  # the blocked copy (or nothing) from here on
        return True

    def int8_linear(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for decode-sized batches, in x's dtype: with fp32 activations, the Q4_1 kernel on
        the checkpoint's own blocks where packed and the batch has at most `q4_max_rows` rows
        (exactly the fp32 weights), else the int8 C kernel; otherwise torch's
        `_weight_int8pack_mm` (bf16 activations). The int8 paths multiply by the int8 weight * scales."""
        if self.q4_blocked is not None and x.shape[0] <= self.q4_max_rows and x.dtype == torch.float32:
            return cpu_q4.q4_linear(x, self.q4_blocked)
        if self.int8_blocked is not None and x.dtype == torch.float32:
            return cpu_int8.int8_linear(x, self.int8_blocked, self.int8_scales)
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scales).to(x.dtype)

    def dense_linear(self, x: torch.Tensor, exact: bool) -> torch.Tensor:
        """x @ dense.T for the int8 format's wide batches: the fp32 copy when `exact`, else
        `dense_fast` (if set); the oneDNN-blocked copy when packed. Output in x's dtype."""
        w = self.dense if exact or self.dense_fast is None else self.dense_fast
        packed = self.packed.get(w.dtype)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.to(w.dtype), packed, None, "none", [], "").to(x.dtype)
        return torch.nn.functional.linear(x.to(w.dtype), w).to(x.dtype)

    def wide_linear(self, x: torch.Tensor, exact: bool) -> torch.Tensor:
        """The int8 format's batches wider than `int8_max_rows`: decode batches (not `exact`) on
        the AMX kernel where packed (the int8 weights themselves, bf16 activations, half the
        bytes of the bf16 dense copy), else `dense_linear`. Output in x's dtype."""
        if not exact and self.int8_tiled is not None and x.dtype == torch.float32:
            return cpu_int8.int8_linear_amx(x, self.int8_tiled, self.int8_scales)
        return self.dense_linear(x, exact)

    def forward(self, x: torch.Tensor, exact: bool = False) -> torch.Tensor:  # x: [T, in] -> [T, out]
        if self.fmt == "int8":
            if x.shape[0] <= self.int8_max_rows:
                return self.int8_linear(x)
            return self.wide_linear(x, exact)
        w = self.weight
        if x.dtype != w.dtype:
            return torch.nn.functional.linear(x.to(w.dtype), w).to(x.dtype)
        return torch.nn.functional.linear(x, w)

    def dequantized(self) -> torch.Tensor:
        """The weight as fp32 [out, in] (for references and tests)."""
        if self.fmt == "int8":
            return self.weight.float() * self.scales.float()[:, None]
        return self.weight.float()


#: The row count oneDNN blocks packed weights for (a hint: any row count works).
_PACK_ROWS = 32


@functools.lru_cache(maxsize=1)
def _onednn_packing() -> bool:
    """Whether this torch build packs linear weights with oneDNN and gets the same result as
    F.linear from them (checked once, on a small weight, in fp32 and bf16)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        for dt in (torch.float32, torch.bfloat16):
            w, x = torch.randn(48, 64).to(dt), torch.randn(5, 64).to(dt)
            y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS),
                                                   None, "none", [], "")
            if not torch.allclose(y.float(), torch.nn.functional.linear(x, w).float(), rtol=2e-2, atol=2e-2):
                return False
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True
