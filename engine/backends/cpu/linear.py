"""The CPU backend's base linears: one immutable module per weight format, and the width dispatch
the int8 format is composed of.

    DenseLinear       a dense fp32 or bf16 weight (only a oneDNN-blocked copy where packed)
    Int8TorchLinear   int8 weight-only (bf16 scales) through torch's `_weight_int8pack_mm`
    Int8KernelLinear  the same weights through the C kernel's blocked copy (engine.backends.cpu.int8)
    Q4Linear          the checkpoint's own Q4_1 blocks through the C Q4_1 kernel (engine.backends.cpu.q4)
    AmxInt8Linear     the int8 weights on AMX tiles (bf16 activations, fp32 accumulation)
    WidthDispatch     the int8 format: a batch of T rows takes its first band whose bound is >= T
                      (the Q4_1 and int8 kernels), else its `wide` module (a dense copy or the
                      AMX kernel), or its `prefill` module in steps that prefill (the exact fp32 copy)

Every module is `lin(x [T, in]) -> [T, out]` in x's dtype, holds only the copy it reads, and is
not changed after it is built. The "fp32" and "bf16" formats are one DenseLinear each. The int8
format loads as a `PendingInt8Linear` (the fp32 weight, its int8 rounding and the checkpoint's
Q4_1 blocks), which `CpuBackend.prepare_model` replaces, whole and once, with the WidthDispatch
`compose_int8` builds by the CPU's rules (engine.backends.cpu.formats).
"""
from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from engine.backends.cpu import int8 as cpu_int8
from engine.backends.cpu import q4 as cpu_q4

_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16"}


class DenseLinear(nn.Module):
    """y = x @ W.T with W [out, in] stored in `dtype` (x is cast to it, the output back to x's
    dtype). `pack`: store only a oneDNN-blocked copy (the same dtype and numerics, without the
    per-call reorder of a plain weight: faster at 1-100 rows; bench/RESULTS.md) where this torch
    build packs (`onednn_packing`)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, *, pack: bool = False):
        super().__init__()
        w = weight.to(dtype).contiguous()
        self.out_features, self.in_features = w.shape
        self.dtype = dtype
        self.packed = pack and onednn_packing()
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS) if self.packed else w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.weight, None, "none", [], "").to(x.dtype)
        if x.dtype != self.dtype:
            return torch.nn.functional.linear(x.to(self.dtype), self.weight).to(x.dtype)
        return torch.nn.functional.linear(x, self.weight)

    def dequantized(self) -> torch.Tensor:
        """The weight as fp32 [out, in] (a plain copy only: a packed one is not read back)."""
        if self.packed:
            raise ValueError("a oneDNN-packed weight is not read back")
        return self.weight.float()

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, {_SHORT.get(self.dtype, self.dtype)}"
                f"{', oneDNN-packed' if self.packed else ''}")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [out, in] -> (int8 [out, in], bf16 scales [out]): per-output-channel symmetric, the
    int8 format's rounding."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.to(torch.bfloat16)


class Int8TorchLinear(nn.Module):
    """y = x @ (q * scales).T through torch's fused weight-only kernel (activations rounded to
    bf16 on the way in): the int8 format's narrow batches where the C kernel cannot take them."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", q)
        self.register_buffer("scales", scales)
        self.out_features, self.in_features = q.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scales).to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        return self.weight.float() * self.scales.float()[:, None]


class Int8KernelLinear(nn.Module):
    """The same product as Int8TorchLinear in fp32 (activations not rounded) through the C int8
    kernel, reading its blocked copy (`cpu_int8.block_weight`; N and K multiples of 16)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.register_buffer("blocked", cpu_int8.block_weight(q))
        self.register_buffer("scales", scales.float())
        self.out_features, self.in_features = q.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # the engine's activations: no conversion on the hot path
            return cpu_int8.int8_linear(x, self.blocked, self.scales)
        return cpu_int8.int8_linear(x.float(), self.blocked, self.scales).to(x.dtype)

    def lora_forward(self, x: torch.Tensor, lora) -> torch.Tensor:
        """forward(x) + the LoRA term `lora` describes (cpu_native.StepCall.fused, checked against
        x: fp32, contiguous), in one kernel call."""
        return cpu_int8.int8_linear(x, self.blocked, self.scales, lora=lora)

    def dequantized(self) -> torch.Tensor:
        q = self.blocked.permute(0, 2, 1, 3).reshape(self.out_features, self.in_features)
        return q.float() * self.scales[:, None]


class AmxInt8Linear(nn.Module):
    """bf16(x) @ (q * scales).T accumulated in fp32 on the AMX tile unit, reading the tiled copy
    (`cpu_int8.tile_weight`): half the bytes of a bf16 dense copy, for batches past the int8
    kernel's crossover on CPUs with AMX."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.register_buffer("tiled", cpu_int8.tile_weight(q))
        self.register_buffer("scales", scales.float())
        self.out_features, self.in_features = q.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return cpu_int8.int8_linear_amx(x, self.tiled, self.scales)
        return cpu_int8.int8_linear_amx(x.float(), self.tiled, self.scales).to(x.dtype)

    def lora_forward(self, x: torch.Tensor, lora) -> torch.Tensor:
        """forward(x) + the LoRA term `lora` describes (as Int8KernelLinear.lora_forward)."""
        return cpu_int8.int8_linear_amx(x, self.tiled, self.scales, lora=lora)

    def dequantized(self) -> torch.Tensor:
        q = self.tiled.permute(0, 3, 1, 2, 4).reshape(self.out_features, self.in_features)
        return q.float() * self.scales[:, None]


class Q4Linear(nn.Module):
    """y = x @ W.T for the checkpoint's Q4_1 weights W, read from the C kernel's blocked copy of
    its blocks (`cpu_q4.block_weight`) at 0.625 bytes a weight: the product with exactly the
    weights the file describes, in fp32."""

    def __init__(self, raw: torch.Tensor):
        super().__init__()
        self.register_buffer("blocked", cpu_q4.block_weight(raw))
        self.out_features = raw.shape[0]
        self.in_features = raw.shape[1] // cpu_q4.BLOCK_BYTES * 32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return cpu_q4.q4_linear(x, self.blocked)
        return cpu_q4.q4_linear(x.float(), self.blocked).to(x.dtype)

    def lora_forward(self, x: torch.Tensor, lora) -> torch.Tensor:
        """forward(x) + the LoRA term `lora` describes (as Int8KernelLinear.lora_forward)."""
        return cpu_q4.q4_linear(x, self.blocked, lora=lora)


def _entries(module: nn.Module) -> tuple:
    """(forward, lora_forward or None) of a WidthDispatch part."""
    return module.forward, getattr(module, "lora_forward", None)


class StepKind:
    """Whether the step being run prefills: set by CpuBackend.begin_step, read by every
    WidthDispatch of that backend (the one piece of per-step state its linears share)."""

    __slots__ = ("prefills",)

    def __init__(self):
        self.prefills = False


class WidthDispatch(nn.Module):
    """The int8 format's linear: `bands` [(max_rows, module)] in ascending order of max_rows; a
    batch of T rows takes the first band with T <= max_rows, else `prefill` where set and the
    step prefills (`step`), else `wide`. Every part is the same weight in another form."""

    def __init__(self, bands: list[tuple[int, nn.Module]], wide: nn.Module, prefill: nn.Module | None,
                 step: StepKind):
        super().__init__()
        self.band_modules = nn.ModuleList(m for _, m in bands)
        self.wide = wide
        self.prefill = prefill
        self.step = step
        self.out_features, self.in_features = wide.out_features, wide.in_features
        # The parts' (forward, lora_forward or None), called directly: a module call's hooks
        # machinery costs microseconds, a share of a one-token step's ~120 linears.
        self._bands = tuple((rows, _entries(m)) for rows, m in bands)
        self._wide = _entries(wide)
        self._prefill = None if prefill is None else (prefill.forward, None)

    @property
    def bands(self) -> list[tuple[int, nn.Module]]:
        return [(rows, m) for (rows, _), m in zip(self._bands, self.band_modules)]

    def _part(self, t: int) -> tuple:
        """The entries of the part a batch of `t` rows takes (the class docstring's rule)."""
        for rows, entries in self._bands:
            if t <= rows:
                return entries
        if self._prefill is not None and self.step.prefills:
            return self._prefill
        return self._wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._part(x.shape[0])[0](x)

    def lora_forward(self, x: torch.Tensor, lora) -> torch.Tensor | None:
        """forward(x) + the LoRA term `lora` describes (cpu_native.StepCall.fused) in one kernel
        call, where the part x takes has a fused entry (the C int8, Q4_1 and AMX kernels; not the
        dense copies, nor the prefill copy); None where not (nothing computed: the caller makes
        the two calls)."""
        fused = self._part(x.shape[0])[1]
        return None if fused is None else fused(x, lora)

    def dequantized(self) -> torch.Tensor:
        """The int8 weights as fp32 [out, in] (what the int8 band multiplies by)."""
        int8 = next(m for m in self.band_modules if isinstance(m, (Int8KernelLinear, Int8TorchLinear)))
        return int8.dequantized()

    def extra_repr(self) -> str:
        bands = ", ".join(f"<= {rows}: {type(m).__name__}" for rows, m in self.bands)
        prefill = f", prefill: {type(self.prefill).__name__}" if self.prefill is not None else ""
        return f"{bands}, wider: {type(self.wide).__name__}{prefill}"


class PendingInt8Linear(nn.Module):
    """An int8-format linear between load and CpuBackend.prepare_model: the fp32 weight, its int8
    rounding (`quantize_int8`) and the checkpoint's raw Q4_1 rows where it has them. Not a
    runnable linear: prepare_model replaces it with `compose_int8`'s WidthDispatch."""

    def __init__(self, weight: torch.Tensor, q4_1: torch.Tensor | None = None):
        super().__init__()
        self.dense = weight.float().contiguous()
        self.q, self.scales = quantize_int8(self.dense)
        self.q4_1 = q4_1
        self.out_features, self.in_features = self.dense.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an int8-format linear runs after CpuBackend.prepare_model composes it")


@dataclasses.dataclass(frozen=True)
class Int8Parts:
    """Which kernels an int8 layer's composition may use (CpuBackend.prepare_model's switches and
    what this CPU built), and the activation dtype."""
    int8_kernel: bool
    amx_kernel: bool
    q4_kernel: bool
    onednn: bool
    activations: torch.dtype = torch.float32

    def int8(self, layer: PendingInt8Linear) -> bool:
        return self.int8_kernel and self.activations == torch.float32 and cpu_int8.supports(layer.q)

    def amx(self, layer: PendingInt8Linear) -> bool:
        return self.amx_kernel and self.int8(layer) and cpu_int8.supports_amx(layer.q)

    def q4(self, layer: PendingInt8Linear) -> bool:
        return self.q4_kernel and self.int8(layer) and layer.q4_1 is not None and cpu_q4.supports(layer.q4_1)


def compose_int8(layer: PendingInt8Linear, parts: Int8Parts, *, int8_max_rows: int, q4_max_rows: int,
                 dense: torch.dtype, exact_prefill: bool, step: StepKind) -> WidthDispatch:
    """The WidthDispatch of one int8 layer: the Q4_1 blocks up to `q4_max_rows` rows (where it has
    them and the kernel takes them), the int8 weights up to `int8_max_rows` (the C kernel where it
    takes them, else torch's), then the AMX kernel where it takes them or the dense copy in
    `dense`, and, where `exact_prefill`, the fp32 copy in steps that prefill. One dense module
    serves both where the dtypes agree."""
    bands: list[tuple[int, nn.Module]] = []
    if q4_max_rows > 0 and parts.q4(layer):
        bands.append((min(q4_max_rows, int8_max_rows), Q4Linear(layer.q4_1)))
    int8 = Int8KernelLinear if parts.int8(layer) else Int8TorchLinear
    bands.append((int8_max_rows, int8(layer.q, layer.scales)))
    copies: dict[torch.dtype, DenseLinear] = {}

    def copy(dt: torch.dtype) -> DenseLinear:
        if dt not in copies:
            copies[dt] = DenseLinear(layer.dense, dt, pack=parts.onednn)
        return copies[dt]

    wide = AmxInt8Linear(layer.q, layer.scales) if parts.amx(layer) else copy(dense)
    prefill = copy(torch.float32) if exact_prefill else None
    return WidthDispatch(bands, wide, None if prefill is wide else prefill, step)


#: The row count oneDNN blocks packed weights for (a hint: any row count works).
_PACK_ROWS = 32


@functools.lru_cache(maxsize=1)
def onednn_packing() -> bool:
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
