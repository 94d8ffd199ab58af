"""W4A16: 4-bit base weights on the device, multiplied by 16-bit (or fp32) activations with the
weights dequantized inside the Triton kernels, so a 4-bit checkpoint stays 4-bit on the GPU.

Semantics:
    # w: W4Weight of N x K weights, groups of G inputs along K (the last group may be shorter)
    W[n, k] = q[n, k] * scale[n, k // G] + min[n, k // G]        # fp32, q in 0..15
    one level:  scale = scales, min = mins
    two levels (super_size S, R = S // G groups a super-block; a K-quant's own form):
        scale[n, g] = super_scales[n, g // R] * scales[n, g]       # fp32, exact; scales uint8 or int8
        min[n, g]   = super_mins[n, g // R] * mins[n, g]
    y[m, :] = x[m, :] @ W.T                                      # fp32 accumulation, y in x's dtype
    # gated (act "silu" / "gelu_tanh"; x = gu [M, 2K], gate | up, the MLP's down projection):
    y[m, :] = act_mul(gu, act)[m, :] @ W.T    # act_mul as norms.silu_mul / gelu_tanh_mul, bit for bit

The format (`W4Weight`):
- `qweight` uint8 [N, K/2], K % 32 == 0, nibbles in input order: byte j holds input 2j in its low
  nibble and input 2j + 1 in its high one, so each little-endian 32-bit word holds 8 consecutive
  inputs (input 8c + p in bits 4p..4p+3 of word c) and a kernel turns a word into 8 weights in
  input order with bit operations alone (below). Each row is K/2 bytes, a multiple of 16, so every
  row starts 16-byte aligned when the tensor does (the launchers check it) and a tile's words
  load as whole 16-byte vectors. A checkpoint's codes (engine.loader.quantized.QuantizedWeight's
  layout, GGUF's Q4_0/Q4_1 block order: byte j of a 32-input block holds inputs j and j + 16) are
  reordered into this layout once, at load (`from_quantized`, `pack_gguf`): the same bytes,
  nibbles moved, nothing dequantized.
- `scales`, `mins` [N, ceil(K / G)], both fp16 or both fp32, G a multiple of 32 (a byte's two
  nibbles then always share a group). The kernels load them in their stored dtype and widen to
  fp32. fp16 where the checkpoint's values are fp16 (GGUF Q4_0/Q4_1, AWQ/GPTQ scales; Q4_0's min
  -8 d is exact in fp16); fp32 where the checkpoint multiplies two of its values (a K-quant's
  super-block d times a sub-block scale, a zero point times a scale), whose product fp16 would
  round: twice the scale bytes, the price of the checkpoint's exact weights. Quantization at load
  time defaults to G = 128 with fp16 scales: a decode GEMV is bound by the bytes it reads, and 4
  bytes of scale and min per 128 weights add 6% to the 4-bit bytes where G = 32 adds 25%. The
  price is a step set by a wider range (each weight is within half its group's step,
  `quantize`); `W4A16Linear(group_size=32)` takes the other side.
- Two levels (`super_size` S > 0, a multiple of G; a GGUF Q4_K's form, QuantizedWeight's
  `super_size`): `scales`, `mins` uint8 or int8 [N, ceil(K / G)], the checkpoint's integer
  sub-block values, and `super_scales`, `super_mins` fp16 or fp32 [N, ceil(K / S)] the super-block's
  factors (Q4_K's d and -dmin). The kernels multiply the two as they load a group's parameters:
  the product (an 11-bit fp16 by an 8-bit integer) is exact in fp32, so every weight is bit for
  bit that of the fp32 one-level form, for 2 bytes a group and 4 a super-block instead of 8 a
  group (Q4_K: 4.625 bits a weight, not 6). A super-block may span K tiles and K chunks: each run
  indexes its super-block by its own k.

The kernels (`w4a16_matmul`), both split-K where a layer's N blocks alone would leave SMs idle:
- M <= GEMV_MAX_M (one row): a GEMV on the CUDA cores. Each thread multiplies its weights by x
  as it dequantizes them and keeps the products in registers; the block reduces once, after the
  K loop, and nothing passes through shared memory but x.
- wider: a tiled product on the tensor cores. Each program streams BLOCK_N x BLOCK_K tiles of
  weights (16-byte loads of 4 words a row, pipelined through shared memory by Triton) and
  multiplies them by all its rows of x with one `tl.dot`, weights as the left operand
  (acc [BLOCK_N, BLOCK_M] = W_tile @ x_tile.T), so a decode step of 2 to 16 rows costs what one
  tile costs: the dequantization, once per weight, is the work, and the tensor cores' products
  are almost free.
Dequantization (both kernels) has no integer-to-float conversion: nibble p of a word, masked in
place (for p < 5; the top three after one shift by 20) and OR-ed into the mantissa of 2^23, is
the float 2^23 + q * 16^p, exactly; subtracting 2^23 leaves q * 16^p, and the group's scale
divided by 16^p (exact: a power of two) with its min gives the weight in one FMA. The GEMV
multiplies each plane by the matching plane of x; the tensor-core kernel interleaves the 8 planes
back into input order in registers (`tl.join`) and rounds them to x's dtype for the product
(fp32 tiles with IEEE products for fp32 activations, for `exact=True`, and under the
interpreter, whose bf16 tl.dot is wrong). Neither reduces across threads inside the K loop.
  With SPLIT_K > 1 each program writes its partial sums to its own slice of an fp32 workspace
  [SPLIT_K, M, N], then counts itself done on its output tile's int32 counter (one atomic add,
  acquire-release, after a barrier so the whole program's stores come first); the program that
  counts last adds the tile's SPLIT_K slices in chunk order (reading through L2, `.cg`), casts
  into y, and sets the counter back to 0 (`split_k_store`). One launch, no zeroing launch (the
  counters are 0 between calls: punica_kernels' `_common.zeroed_counters`), and the same input gives the same bits on
  every run whichever program finishes last, because the sum's order is the chunks', not the
  arrival order (atomic adds of the partials would sum in arrival order). The workspace is
  SPLIT_K x M x N x 4 bytes, written and read back at once, so it stays in L2.
  The gated mode (`act`) computes each loaded element of its input as act(gate) * up from the two
  halves of gu (norms.gated_act_mul: the activation kernel's own numerics), so the MLP's down
  projection needs no activation launch; every N tile's program recomputes its rows' values,
  which is why the Triton backend fuses only up to GATED_MAX_M rows (the one-row GEMV).
Block sizes come from `CONFIGS` (data, keyed by device name, path, N, K; `pick_config`): BLOCK_M
is the rows' next power of two from 16 up to the config's. The launch plan, the split-K store,
the gated input and the activation checks are shared with the 8-bit kernels (w8a16.py, whose
CUDA-core GEMV takes up to 16 rows: `launch_plan(gemv_max_m=...)`).

`W4A16Linear` takes a float weight (quantized at load) or a checkpoint's 4-bit QuantizedWeight
(its codes, scales and mins to the device as they are, the codes' nibbles reordered there). A QuantizedWeight with an input
permutation (GPTQ act-order) keeps `perm` on the device and multiplies x[:, perm]: one gather of
the activations a call (T x K elements, against the N x K / 2 weight bytes the kernel reads).

Where the kernels run: Triton builds them for the GPU or for the interpreter by TRITON_INTERPRET
when this module is imported: compiled kernels take CUDA tensors, interpreted ones CPU tensors
(`check_runnable`); the torch `dequantize` is the reference and runs anywhere.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import nn

from engine.backends.triton.norms import GATED_ACTIVATIONS, gated_act_mul
from engine.loader.quantized import SUB_SCALE_DTYPES, QuantizedWeight, per_group_values
from punica_kernels.kernels import _common

#: K must be a multiple of this (and the group size: a tile's 4-word runs share a group); a
#: checkpoint's 4-bit blocks are this wide too.
PACK = 32
#: Group size of load-time quantization (see the module docstring).
DEFAULT_GROUP_SIZE = 128
#: GGUF block bytes per type: fp16 d (Q4_1: then fp16 m), then 16 bytes of nibbles.
GGUF_BLOCK_BYTES = {"q4_0": 18, "q4_1": 20}
#: The dtypes scales and mins may have (both the same): the kernels widen them to fp32 as loaded.
SCALE_DTYPES = (torch.float16, torch.float32)
#: Widest M the CUDA-core GEMV takes (one row: a decode step of one sequence); wider goes to the
#: tensor-core kernel, whose time does not grow with M up to its 16-row tile.
GEMV_MAX_M = 1
#: Widest M for which the Triton backend computes the MLP's gated activation inside the down
#: projection's kernel (TritonBackend.gated_linear): one row, the GEMV. Every N tile's program
#: recomputes the activation of the rows it reads; on the one-row GEMV that costs about the
#: activation launch it saves, while the tensor-core kernel, whose loop is cheap per row, would
#: spend more on it than the launch costs.
GATED_MAX_M = 1
#: Most products one GEMV program holds at once (BLOCK_M x BLOCK_N x BLOCK_K / inputs per
#: product); past it the tile shrinks so the fp32 products fit in registers (128 threads x 64
#: each).
GEMV_TILE_BUDGET = 8192


#: Whether this process built its Triton kernels for the interpreter (punica_kernels.kernels._common).
INTERPRETED: bool = _common.INTERPRETED


def check_runnable(device: torch.device, what: str = "the W4A16") -> None:
    """Raise RuntimeError unless this module's kernels (or those `what` names, built in the same
    process) can run on tensors of `device`."""
    _common.check_runnable(device, what, cpu_hint="")


# ----------------------------------------------------------------------------- the format


@dataclasses.dataclass(frozen=True)
class W4Weight:
    """N x K 4-bit weights (see the module docstring for the layout)."""

    qweight: torch.Tensor  # uint8 [N, K/2]: byte j = input 2j | input 2j + 1 << 4
    scales: torch.Tensor  # fp16 or fp32 [N, ceil(K / group_size)]; two levels: uint8/int8 sub-block scales
    mins: torch.Tensor  # scales' dtype and shape: W = q * scale + min; two levels: sub-block mins
    group_size: int  # inputs per (scale, min), a multiple of 32
    super_scales: torch.Tensor | None = None  # two levels: fp16 or fp32 [N, ceil(K / super_size)]
    super_mins: torch.Tensor | None = None  # two levels: super_scales' dtype and shape
    super_size: int = 0  # inputs per super-block, a multiple of group_size; 0: one level

    def __post_init__(self):
        q, s, m, g = self.qweight, self.scales, self.mins, self.group_size
        if q.dtype != torch.uint8 or q.dim() != 2:
            raise ValueError(f"qweight must be uint8 [N, K/2], not {q.dtype} {tuple(q.shape)}")
        if g <= 0 or g % PACK:
            raise ValueError(f"group_size must be a positive multiple of {PACK}, not {g}")
        if q.shape[1] % (PACK // 2):
            raise ValueError(f"K must be a multiple of {PACK}: qweight has {q.shape[1]} bytes a row")
        two = self.super_size != 0
        if two and (self.super_size < 0 or self.super_size % g):
            raise ValueError(f"super_size must be a positive multiple of group_size {g}, not {self.super_size}")
        if not two and (self.super_scales is not None or self.super_mins is not None):
            raise ValueError("super_scales and super_mins need a super_size (two levels)")
        groups = (self.K + g - 1) // g
        kinds, what = (SUB_SCALE_DTYPES, "uint8/int8 (two levels)") if two else (SCALE_DTYPES, "float16/float32")
        checks = [("scales", s, kinds, what, groups), ("mins", m, kinds, what, groups)]
        if two:
            supers = (self.K + self.super_size - 1) // self.super_size
            checks += [(name, t, SCALE_DTYPES, "float16/float32", supers)
                       for name, t in (("super_scales", self.super_scales), ("super_mins", self.super_mins))]
        for name, t, dtypes, what, cols in checks:
            if t is None or t.dtype not in dtypes or tuple(t.shape) != (self.N, cols):
                got = "None" if t is None else f"{t.dtype} {tuple(t.shape)}"
                raise ValueError(f"{name} must be {what} [{self.N}, {cols}], not {got}")
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device}, qweight on {q.device}")
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        if m.dtype != s.dtype:
            raise ValueError(f"scales ({s.dtype}) and mins ({m.dtype}) must share a dtype")
        if two and self.super_mins.dtype != self.super_scales.dtype:
            raise ValueError(f"super_scales ({self.super_scales.dtype}) and super_mins ({self.super_mins.dtype}) "
                             "must share a dtype")
        if not q.is_contiguous():
            raise ValueError("qweight must be contiguous")

    @property
    def N(self) -> int:
        return self.qweight.shape[0]

    @property
    def K(self) -> int:
        return self.qweight.shape[1] * 2

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def nbytes(self) -> int:
        """Bytes the kernels read for the weights: nibbles, scales and mins (and super-block factors)."""
        return sum(t.numel() * t.element_size()
                   for t in (self.qweight, self.scales, self.mins, self.super_scales, self.super_mins) if t is not None)

    def to(self, device: torch.device | str) -> W4Weight:
        move = lambda t: None if t is None else t.to(device)
        return W4Weight(self.qweight.to(device), self.scales.to(device), self.mins.to(device), self.group_size,
                        move(self.super_scales), move(self.super_mins), self.super_size)

    def group_scales(self) -> torch.Tensor:
        """Each group's scale, fp32 [N, ceil(K / group_size)] (two levels: the exact products)."""
        return per_group_values(self.scales, self.super_scales, self.group_size, self.super_size)

    def group_mins(self) -> torch.Tensor:
        """Each group's min, fp32 [N, ceil(K / group_size)]."""
        return per_group_values(self.mins, self.super_mins, self.group_size, self.super_size)


def supported(weight: torch.Tensor) -> bool:
    """Whether a float [N, K] weight can take this format (K a multiple of 32); a backend keeps
    other weights dense."""
    return weight.dim() == 2 and weight.is_floating_point() and weight.shape[1] % PACK == 0


def from_quantized(qw: QuantizedWeight) -> W4Weight:
    """A checkpoint's 4-bit QuantizedWeight as a W4Weight, without its input permutation (the
    caller gathers x through `qw.perm`): the codes' nibbles reordered into this module's layout
    (`sequential_from_blocked`), scales as they are (two levels stay two levels), mins None ->
    zeros in the scales' dtype (and the super-block factors'). ValueError for another bit width."""
    if not isinstance(qw, QuantizedWeight) or qw.bits != 4:
        what = f"{qw.bits}-bit QuantizedWeight" if isinstance(qw, QuantizedWeight) else type(qw).__name__
        raise ValueError(f"the W4A16 format takes 4-bit QuantizedWeights, not a {what}")
    mins = torch.zeros_like(qw.scales) if qw.mins is None else qw.mins
    two = {}
    if qw.super_size:
        super_mins = torch.zeros_like(qw.super_scales) if qw.super_mins is None else qw.super_mins
        two = {"super_scales": qw.super_scales.contiguous(), "super_mins": super_mins.contiguous(),
               "super_size": qw.super_size}
    return W4Weight(sequential_from_blocked(qw.codes.contiguous()), qw.scales.contiguous(), mins.contiguous(),
                    qw.group_size, **two)


def pack_gguf(raw: torch.Tensor, qtype: str) -> W4Weight:
    """GGUF Q4_0 / Q4_1 rows (uint8 [N, K/32 * block bytes], blocks as in the file) -> W4Weight
    with group size 32, dequantizing to exactly what gguf.quants.dequantize gives."""
    if qtype not in GGUF_BLOCK_BYTES:
        raise ValueError(f"qtype must be one of {sorted(GGUF_BLOCK_BYTES)}, not {qtype!r}")
    bb = GGUF_BLOCK_BYTES[qtype]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % bb:
        raise ValueError(f"{qtype} rows must be uint8 [N, K/32 * {bb}], not {raw.dtype} {tuple(raw.shape)}")
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, bb)
    d = blocks[..., 0:2].contiguous().view(torch.float16).reshape(n, -1)
    if qtype == "q4_1":
        mins = blocks[..., 2:4].contiguous().view(torch.float16).reshape(n, -1)
    else:
        # Q4_0: d * (q - 8) = q * d + (-8 d); -8 d is exact in fp16 unless it overflows.
        mins = (d.float() * -8.0).half()
        if not torch.isfinite(mins[torch.isfinite(d)]).all():
            raise ValueError("a Q4_0 scale is too large for -8 x scale to fit in float16")
    qweight = sequential_from_blocked(blocks[..., bb - PACK // 2:].reshape(n, -1))
    return W4Weight(qweight, d.contiguous(), mins.contiguous(), PACK)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values 0..15 -> uint8 [N, K/2] in input order (byte j: inputs 2j, 2j + 1)."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def _unpack_nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> the values 0..15 as uint8 [N, K] in input order."""
    return torch.stack([qweight & 0x0F, qweight >> 4], dim=2).reshape(qweight.shape[0], -1)


def sequential_from_blocked(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] in 32-input blocks (byte j of a block: inputs j and j + 16; GGUF's order and
    QuantizedWeight's) -> this module's layout, on codes' device, row chunk by row chunk so a
    large matrix needs little more than its own size."""
    n, kb = codes.shape
    out = torch.empty_like(codes)
    step = max(1, (1 << 24) // max(kb, 1))
    for r in range(0, n, step):
        blocks = codes[r:r + step].reshape(-1, kb // (PACK // 2), PACK // 2)
        lo, hi = blocks & 0x0F, blocks >> 4  # inputs j and j + 16 of each block
        values = torch.cat([lo, hi], dim=2).reshape(blocks.shape[0], -1)
        out[r:r + step] = _pack_nibbles(values)
    return out


def _fp16_down(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> the largest fp16 value <= t (t finite and within fp16's range)."""
    h = t.half()
    over = h.float() > t
    return torch.where(over, torch.nextafter(h, torch.full_like(h, -torch.inf)), h)


def _fp16_up(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> the smallest fp16 value >= t."""
    h = t.half()
    under = h.float() < t
    return torch.where(under, torch.nextafter(h, torch.full_like(h, torch.inf)), h)


def quantize(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> W4Weight:
    """float [N, K] (K % 32 == 0) -> W4Weight: per group of `group_size` inputs along K, asymmetric
    round-to-nearest: min = the group's minimum rounded down to fp16, scale = (max - min) / 15
    rounded up to fp16, q = round((w - min) / scale). Rounding min down and scale up keeps
    (w - min) / scale within [0, 15], so no value is clamped and every weight is within
    scale / 2 of its dequantized value (fp32 arithmetic aside). Runs on the weight's device."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a float [N, K] tensor, not {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    if k % PACK:
        raise ValueError(f"K must be a multiple of {PACK}, not {k}")
    if group_size <= 0 or group_size % PACK:
        raise ValueError(f"group_size must be a positive multiple of {PACK}, not {group_size}")
    w = weight.float()
    if w.numel() and not (torch.isfinite(w).all() and w.abs().max().item() <= 60000.0):
        raise ValueError("weights must be finite and within float16's range to quantize")
    groups = -(-k // group_size)
    # Pad the last group with copies of its last input: they change neither its min nor its max.
    padded = torch.nn.functional.pad(w, (0, groups * group_size - k), mode="replicate") if groups * group_size != k else w
    wg = padded.reshape(n, groups, group_size)
    lo = _fp16_down(wg.amin(dim=2))
    scale = _fp16_up((wg.amax(dim=2) - lo.float()) / 15.0)
    s32 = scale.float()[..., None]
    safe = torch.where(s32 > 0, s32, torch.ones_like(s32))
    q = torch.where(s32 > 0, torch.round((wg - lo.float()[..., None]) / safe), torch.zeros_like(wg))
    q = q.clamp_(0, 15).to(torch.uint8).reshape(n, groups * group_size)[:, :k]
    return W4Weight(_pack_nibbles(q.contiguous()), scale.contiguous(), lo.contiguous(), group_size)


def dequantize(w: W4Weight) -> torch.Tensor:
    """The reference: fp32 [N, K] = q * scale + min, in torch on w's device."""
    q = _unpack_nibbles(w.qweight).float()
    scales = w.group_scales().repeat_interleave(w.group_size, dim=1)[:, :w.K]
    mins = w.group_mins().repeat_interleave(w.group_size, dim=1)[:, :w.K]
    return q * scales + mins


# ----------------------------------------------------------------------------- configs


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of one path. Tile sizes are powers of two; block_k >= 32 (one packing
    block; the 8-bit kernels: 16, one run); the GEMM's block_m, block_n >= 16 (the tensor cores'
    smallest tile)."""

    block_n: int
    block_k: int
    split_k: int = 0  # K chunks, one program each; 0: enough programs for a large GPU (_auto_split)
    block_m: int = 16  # GEMM: the widest M tile (narrower for fewer rows, >= 16); the GEMV takes all M rows
    num_warps: int = 4
    num_stages: int = 2


#: (device name, path, N, K) -> config; N = K = 0 is that device's default for the path, and the
#: device "default" serves devices never tuned. Tuning on a GPU is editing this table
#: (bench/kernels.py --device cuda prints each shape's figures).
CONFIGS: dict[tuple[str, str, int, int], KernelConfig] = {
    # GEMV: 16 weight rows x 256 inputs a tile (eight 16-byte loads a row), two warps.
    ("default", "gemv", 0, 0): KernelConfig(block_n=16, block_k=256, split_k=0, num_warps=2, num_stages=2),
    # 64 weight rows x 128 inputs a tile (64 bytes of each row: four 16-byte loads), up to 64
    # rows of x; K split until the grid fills the GPU.
    ("default", "gemm", 0, 0): KernelConfig(block_n=64, block_k=128, split_k=0, block_m=64, num_warps=4, num_stages=3),
    # H100 / H200 GEMV: 128 rows x 128 inputs (64 bytes of each row), four warps: 16 words a
    # thread, so each x element loaded (and, gated, activated) and each run's address arithmetic
    # serve 4 rows. bench/sass.py at Llama-3.1-8B shapes: every decode GEMV's issue estimate
    # within 1.15x its bytes' at group 128 and under them at group 32 (64 rows: up to 1.20x),
    # 128 registers, no spill (bench/RESULTS.md).
    **{(gpu, "gemv", 0, 0): KernelConfig(block_n=128, block_k=128, split_k=0, num_warps=4, num_stages=2)
       for gpu in ("NVIDIA H100 80GB HBM3", "NVIDIA H200")},
}

#: Programs the automatic split-K aims at: two per SM of an H100 (132 SMs).
_TARGET_PROGRAMS = 264


def pick_config(device_name: str, path: str, n: int, k: int,
                configs: dict[tuple[str, str, int, int], KernelConfig] | None = None) -> KernelConfig:
    """The config for a (device, path, N, K) from `configs` (None: this module's CONFIGS): the
    exact entry, else the device's default for the path, else the untuned default."""
    if path not in ("gemv", "gemm"):
        raise ValueError(f"path must be 'gemv' or 'gemm', not {path!r}")
    table = CONFIGS if configs is None else configs
    if ("default", path, 0, 0) not in table:
        raise ValueError(f"no {path!r} kernel configs in this table")
    for key in ((device_name, path, n, k), (device_name, path, 0, 0), ("default", path, n, k)):
        if key in table:
            return table[key]
    return table[("default", path, 0, 0)]


def _auto_split(n_programs: int, k_tiles: int) -> int:
    return max(1, min(k_tiles, -(-_TARGET_PROGRAMS // max(n_programs, 1)), 16))


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _exponent_bits(N):
    """2^23's bits (0x4B000000) as a uint32 the compilers cannot fold into a constant (N > 0 in
    every launch): `_biased_halves` needs it as a run-time value."""
    return tl.where(N > 0, 0x4B000000, 0).to(tl.uint32)


@triton.jit
def _biased_halves(words, bias):
    """The two biased forms of each uint32 word (both kernels' dequantization): nibbles 0..4 in
    place and nibbles 5..7 shifted down 20 bits (whose bits would otherwise reach the exponent),
    each OR-ed with `bias`, 2^23's bits (`_exponent_bits`). A plane is then one AND with one
    constant (`_biased_plane`): two instructions a word here instead of a second constant in
    every plane's AND. `bias` is a run-time value: as a literal, the compilers fold the OR back
    into each plane's AND,
    (w & mask) | 0x4B000000, a LOP3 with two constants, one of them in a register; short of
    registers, ptxas re-creates those masks with a MOV in every iteration (about 55 of the 423
    instructions of the 16 x 256 GEMV loop; the 64 x 128 GEMM's loop at 8 rows went from 505
    instructions and 127 registers to 446 and 102)."""
    return (words & 0xFFFFF) | bias, (words >> 20) | bias


@triton.jit
def _biased_plane(lo, hi, sc, mn, P: tl.constexpr):
    """fp32 weights of nibble P (0..7) of each word, q * sc + mn, from `_biased_halves`' (lo, hi),
    with no integer-to-float conversion: the AND keeps the exponent bits and nibble P's, the float
    2^23 + q * 16^p exactly (p = P, or P - 5 in hi); 2^23 is subtracted, and the scale divided by
    16^p (exact: a power of two) gives the weight in one FMA."""
    if P < 5:
        v = lo & (0xFF800000 | (0xF << (4 * P)))
    else:
        v = hi & (0xFF800000 | (0xF << (4 * (P - 5))))
    q = v.to(tl.float32, bitcast=True) - 8388608.0
    if P % 5 == 0:
        return q * sc + mn
    return q * (sc * (1.0 / (16 ** (P % 5)))) + mn


@triton.jit
def _load_words(words_ptr, s_ptr, m_ptr, ss_ptr, sm_ptr, rows, mask_n, k0, K, stride_w, stride_s, stride_ss,
                G: tl.constexpr, NB: tl.constexpr, SUPER: tl.constexpr):
    """One K tile's codes and group parameters for `rows`: (uint32 words [BLOCK_N, NB, 4], fp32
    scales and mins [BLOCK_N, NB, 1], mask of the tile's 32-input runs [NB]). Run b holds inputs
    k0 + 32 b .. + 31 of each row: 4 words of one 16-byte load, one group's scale and min (loaded
    once a run, not once a weight); 0 past K and for masked rows. SUPER > 0 (two levels, SUPER
    groups a super-block): the scale and min are the group's uint8 values times its super-block's
    factors (ss_ptr, sm_ptr; row stride stride_ss), exact in fp32; SUPER 0 ignores those."""
    b = tl.arange(0, NB)
    i = tl.arange(0, 4)
    # Alignment: k0 % 32 == 0 (chunks and steps are whole tiles), so the first word is a multiple
    # of 4; rows are K/8 words apart, a multiple of 4, from a 16-byte aligned base (checked by the
    # launcher). Each run's 4 words are therefore one aligned 16-byte vector.
    kw0 = tl.multiple_of(k0 // 8, 4)
    mask_b = (k0 + b * 32) < K  # K % 32 == 0: a run is wholly in or out
    words = tl.load(words_ptr + rows[:, None, None] * stride_w + (kw0 + b[:, None] * 4 + i[None, :])[None, :, :],
                    mask=mask_n[:, None, None] & mask_b[None, :, None], other=0)
    g = (k0 + b * 32) // G  # G % 32 == 0: a run shares one group
    s_off = rows[:, None] * stride_s + g[None, :]
    mask_s = mask_n[:, None] & mask_b[None, :]
    if SUPER > 0:
        # A super-block may span tiles and K chunks: each run indexes its own by its group.
        f_off = rows[:, None] * stride_ss + (g // SUPER)[None, :]
        sc = (tl.load(s_ptr + s_off, mask=mask_s, other=0).to(tl.float32)
              * tl.load(ss_ptr + f_off, mask=mask_s, other=0.0).to(tl.float32))[:, :, None]
        mn = (tl.load(m_ptr + s_off, mask=mask_s, other=0).to(tl.float32)
              * tl.load(sm_ptr + f_off, mask=mask_s, other=0.0).to(tl.float32))[:, :, None]
    else:
        sc = tl.load(s_ptr + s_off, mask=mask_s, other=0.0).to(tl.float32)[:, :, None]
        mn = tl.load(m_ptr + s_off, mask=mask_s, other=0.0).to(tl.float32)[:, :, None]
    return words, sc, mn, mask_b


@triton.jit
def _stepped_bases(words_ptr, s_ptr, m_ptr, ss_ptr, sm_ptr, rows, stride_w, stride_s, stride_ss, G: tl.constexpr,
                   NB: tl.constexpr, SUPER: tl.constexpr):
    """The loop-invariant pointers `_load_stepped` offsets (kernels launched with STEPPED): a K tile's
    words, scales and mins (two levels: and super-block factors) at k0 = 0 for `rows`, in
    _load_words' shapes. A tile's loads are then these pointers plus one scalar each, unmasked:
    recomputing masks and 64-bit offsets from k0 in every trip is about a tenth of a GEMV loop's
    instructions."""
    b = tl.arange(0, NB)
    i = tl.arange(0, 4)
    w_base = words_ptr + rows[:, None, None] * stride_w + (b[:, None] * 4 + i[None, :])[None, :, :]
    g_off = rows[:, None] * stride_s + (b * 32 // G)[None, :]
    f_off = rows[:, None] * stride_ss + (b * 32 // (G * tl.maximum(SUPER, 1)))[None, :]
    return w_base, s_ptr + g_off, m_ptr + g_off, ss_ptr + f_off, sm_ptr + f_off


@triton.jit
def _load_stepped(w_base, s_base, m_base, ss_base, sm_base, k0, G: tl.constexpr, SUPER: tl.constexpr):
    """_load_words' (words, scales, mins) of the tile at k0 (a multiple of the tile) through
    `_stepped_bases`' pointers, unmasked; two levels multiply each group's values by its
    super-block's factors as _load_words does."""
    words = tl.load(w_base + tl.multiple_of(k0 // 8, 4))
    g = k0 // G
    if SUPER > 0:
        f = k0 // (G * SUPER)
        sc = (tl.load(s_base + g).to(tl.float32) * tl.load(ss_base + f).to(tl.float32))[:, :, None]
        mn = (tl.load(m_base + g).to(tl.float32) * tl.load(sm_base + f).to(tl.float32))[:, :, None]
    else:
        sc = tl.load(s_base + g).to(tl.float32)[:, :, None]
        mn = tl.load(m_base + g).to(tl.float32)[:, :, None]
    return words, sc, mn


@triton.jit
def _dequant_words(words, sc, mn, bias, DTYPE: tl.constexpr):
    """A K tile's weights from _load_words' (words [BLOCK_N, NB, 4], scales, mins): [BLOCK_N,
    NB * 32] in input order and DTYPE; `bias` 2^23's bits as a run-time value (_biased_halves)."""
    lo, hi = _biased_halves(words, bias)
    p0 = _biased_plane(lo, hi, sc, mn, 0).to(DTYPE)
    p1 = _biased_plane(lo, hi, sc, mn, 1).to(DTYPE)
    p2 = _biased_plane(lo, hi, sc, mn, 2).to(DTYPE)
    p3 = _biased_plane(lo, hi, sc, mn, 3).to(DTYPE)
    p4 = _biased_plane(lo, hi, sc, mn, 4).to(DTYPE)
    p5 = _biased_plane(lo, hi, sc, mn, 5).to(DTYPE)
    p6 = _biased_plane(lo, hi, sc, mn, 6).to(DTYPE)
    p7 = _biased_plane(lo, hi, sc, mn, 7).to(DTYPE)
    # Interleave the planes into input order: join appends a last axis of 2, so the outermost
    # join picks P's lowest bit; flattened, [.., word, 2, 2, 2] reads p0, p1, ..., p7 a word.
    even = tl.join(tl.join(p0, p4), tl.join(p2, p6))
    odd = tl.join(tl.join(p1, p5), tl.join(p3, p7))
    return tl.reshape(tl.join(even, odd), (words.shape[0], words.shape[1] * 32))


@triton.jit
def load_input(x_ptr, offs, mask, K, ACT: tl.constexpr):
    """The product's input at element offsets `offs` of x: x itself (ACT "none"), or the gated
    activation of a gate | up row, act(x[offs]) * x[K + offs] in x's dtype (norms.gated_act_mul,
    the numerics of silu_mul / gelu_tanh_mul). 0 where masked."""
    if ACT == "none":
        return tl.load(x_ptr + offs, mask=mask, other=0.0)
    g = tl.load(x_ptr + offs, mask=mask, other=0.0)
    u = tl.load(x_ptr + K + offs, mask=mask, other=0.0)
    return gated_act_mul(g, u, ACT)


@triton.jit
def split_k_store(acc, base, offs, mask, tile, pid_k, num_k, out_ptr, y_ptr, cnt_ptr, stride_ok,
                  SPLIT: tl.constexpr):
    """Store a program's fp32 result tile `acc` of y (element offsets base + offs into y [M, N]:
    `base` the tile's, a 64-bit scalar, `offs` within the tile, 32-bit, so no tile of 64-bit
    offsets or pointers stays live; `mask` inside y). SPLIT off (one K chunk): acc is the
    result, written to y in y's dtype.
    SPLIT on: acc is K chunk `pid_k`'s partial sum of output tile `tile`, one of `num_k`; it goes
    to the fp32 workspace slice out[pid_k] (stride_ok elements a slice), and the tile's last
    program to finish (the one whose increment of cnt[tile] sees num_k - 1) adds the num_k slices
    in chunk order, writes y and sets cnt[tile] back to 0 (see the module docstring)."""
    y_tile = y_ptr + base
    if SPLIT:
        ws_tile = out_ptr + base  # slice 0's tile; slice s is stride_ok elements further
        tl.store(ws_tile + pid_k.to(tl.int64) * stride_ok + offs, acc, mask=mask)
        # Every thread's partial stores are issued before the one atomic (a single thread's),
        # whose release orders them before the count; its acquire orders the reads below after
        # the other programs' stores.
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == num_k - 1:
            total = tl.zeros_like(acc)
            for _ in range(num_k):
                # .cg: from L2, where the other programs' stores are; never a stale L1 line.
                total += tl.load(ws_tile + offs, mask=mask, other=0.0, cache_modifier=".cg")
                ws_tile += stride_ok  # a scalar 64-bit pointer: num_k x M x N may pass 2^31
            tl.store(y_tile + offs, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")
    else:
        tl.store(y_tile + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _w4_gemv_kernel(
    x_ptr, q_ptr, s_ptr, m_ptr, ss_ptr, sm_ptr, out_ptr, y_ptr, cnt_ptr,
    M, N, K, K_CHUNK, stride_xm, stride_q, stride_s, stride_ss, stride_om, stride_ok,
    G: tl.constexpr, SUPER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, ACT: tl.constexpr, STEPPED: tl.constexpr,
):
    # One row of x (M == 1). grid = (cdiv(N, BLOCK_N), SPLIT_K); program (n, s) computes K chunk
    # s of output tile n (split_k_store). Each thread keeps its products in registers,
    # [BLOCK_N, NB, 4] fp32 (a word's 8 products summed into one), and the block reduces once,
    # after the K loop.
    # STEPPED: the tiles load through _stepped_bases (`stepped`).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    NB: tl.constexpr = BLOCK_K // 32
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    b = tl.arange(0, NB)
    i = tl.arange(0, 4)
    j = tl.arange(0, 8)
    words_ptr = q_ptr.to(tl.pointer_type(tl.uint32))
    stride_w = tl.multiple_of(stride_q // 4, 4)
    acc = tl.zeros([BLOCK_N, NB, 4], dtype=tl.float32)
    bias = _exponent_bits(N)
    k_start = pid_k * K_CHUNK
    k_end = tl.minimum(k_start + K_CHUNK, K)
    if STEPPED:
        w_base, s_base, m_base, ss_base, sm_base = _stepped_bases(words_ptr, s_ptr, m_ptr, ss_ptr, sm_ptr, rows,
                                                                  stride_w, stride_s, stride_ss, G, NB, SUPER)
    for k0 in range(k_start, k_end, BLOCK_K):
        if STEPPED:
            words, sc, mn = _load_stepped(w_base, s_base, m_base, ss_base, sm_base, k0, G, SUPER)
            mask_b = b < NB
        else:
            words, sc, mn, mask_b = _load_words(words_ptr, s_ptr, m_ptr, ss_ptr, sm_ptr, rows, mask_n, k0, K,
                                                stride_w, stride_s, stride_ss, G, NB, SUPER)
        # x of word (b, i): inputs k0 + 32 b + 8 i + P, as [NB, 4, 8] split into its 8 planes P
        # (the same halving as the weights' joins: the last axis of 2 is P's lowest bit).
        xv = load_input(x_ptr, k0 + b[:, None, None] * 32 + i[None, :, None] * 8 + j[None, None, :],
                     mask_b[:, None, None], K, ACT).to(tl.float32)
        x_even, x_odd = tl.split(tl.reshape(xv, (NB, 4, 4, 2)))
        x04, x26 = tl.split(tl.reshape(x_even, (NB, 4, 2, 2)))
        x15, x37 = tl.split(tl.reshape(x_odd, (NB, 4, 2, 2)))
        x0, x4 = tl.split(x04)
        x2, x6 = tl.split(x26)
        x1, x5 = tl.split(x15)
        x3, x7 = tl.split(x37)
        lo, hi = _biased_halves(words, bias)
        acc += x0[None] * _biased_plane(lo, hi, sc, mn, 0)
        acc += x1[None] * _biased_plane(lo, hi, sc, mn, 1)
        acc += x2[None] * _biased_plane(lo, hi, sc, mn, 2)
        acc += x3[None] * _biased_plane(lo, hi, sc, mn, 3)
        acc += x4[None] * _biased_plane(lo, hi, sc, mn, 4)
        acc += x5[None] * _biased_plane(lo, hi, sc, mn, 5)
        acc += x6[None] * _biased_plane(lo, hi, sc, mn, 6)
        acc += x7[None] * _biased_plane(lo, hi, sc, mn, 7)
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    split_k_store(y, 0, offs_n, mask_n, pid_n, pid_k, tl.num_programs(1), out_ptr, y_ptr, cnt_ptr, stride_ok, SPLIT)


@triton.jit
def _w4_gemm_kernel(
    x_ptr, q_ptr, s_ptr, m_ptr, ss_ptr, sm_ptr, out_ptr, y_ptr, cnt_ptr,
    M, N, K, K_CHUNK, stride_xm, stride_q, stride_s, stride_ss, stride_om, stride_ok,
    G: tl.constexpr, SUPER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, SPLIT: tl.constexpr, ACT: tl.constexpr, STEPPED: tl.constexpr,
):
    # grid = (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), SPLIT_K); program (m, n, s) computes K chunk s
    # of output tile (m, n) (split_k_store). M blocks vary fastest: programs running together
    # share weight tiles. STEPPED: the tiles load through _stepped_bases (`stepped`).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_m = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)  # row * stride must not wrap at 2^31 bytes
    kk = tl.arange(0, BLOCK_K)
    words_ptr = q_ptr.to(tl.pointer_type(tl.uint32))
    stride_w = tl.multiple_of(stride_q // 4, 4)  # rows are K/2 bytes, a multiple of 16
    if IEEE:
        dtype = tl.float32
    else:
        dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    bias = _exponent_bits(N)
    k_start = pid_k * K_CHUNK  # K_CHUNK % BLOCK_K == 0: tiles never straddle two chunks
    k_end = tl.minimum(k_start + K_CHUNK, K)
    if STEPPED:
        w_base, s_base, m_base, ss_base, sm_base = _stepped_bases(words_ptr, s_ptr, m_ptr, ss_ptr, sm_ptr, rows,
                                                                  stride_w, stride_s, stride_ss, G, BLOCK_K // 32,
                                                                  SUPER)
    for k0 in range(k_start, k_end, BLOCK_K):
        if STEPPED:
            words, sc, mn = _load_stepped(w_base, s_base, m_base, ss_base, sm_base, k0, G, SUPER)
        else:
            words, sc, mn, _ = _load_words(words_ptr, s_ptr, m_ptr, ss_ptr, sm_ptr, rows, mask_n, k0, K, stride_w,
                                           stride_s, stride_ss, G, BLOCK_K // 32, SUPER)
        w = _dequant_words(words, sc, mn, bias, dtype)
        e = k0 + kk
        x = load_input(x_ptr, offs_m[None, :] * stride_xm + e[:, None], mask_m[None, :] & (e < K)[:, None], K,
                    ACT).to(dtype)
        if IEEE:
            acc += tl.dot(w, x, input_precision="ieee")
        else:
            acc += tl.dot(w, x)
    tile = pid_n * tl.num_programs(0) + pid_m
    base = pid_m.to(tl.int64) * BLOCK_M * stride_om
    offs = tl.arange(0, BLOCK_M)[None, :] * stride_om + offs_n[:, None]  # < BLOCK_M x N: 32 bits
    split_k_store(acc, base, offs, mask_m[None, :] & mask_n[:, None], tile, pid_k, tl.num_programs(2), out_ptr, y_ptr,
                  cnt_ptr, stride_ok, SPLIT)


# ----------------------------------------------------------------------------- launcher


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What one call launches: the path and the tile sizes, K split and warps actually used."""

    path: str  # "gemv" | "gemm"
    block_m: int
    block_n: int
    block_k: int
    split_k: int  # programs along K; > 1: partial sums to a workspace, summed by each tile's last program
    k_chunk: int  # inputs per K program, a multiple of block_k
    num_warps: int
    num_stages: int


def launch_plan(m: int, n: int, k: int, device: torch.device, *, path: str | None = None,
                config: KernelConfig | None = None,
                configs: dict[tuple[str, str, int, int], KernelConfig] | None = None,
                min_block_k: int = PACK, inputs_per_product: int = 2,
                gemv_max_m: int = GEMV_MAX_M) -> LaunchPlan:
    """The launch for an [m, k] x [n, k].T product on `device`: the path (None: GEMV up to
    `gemv_max_m` rows, the 4-bit GEMV's GEMV_MAX_M unless the caller passes its own; else GEMM),
    the config (None: pick_config's from `configs`, None: CONFIGS), the GEMM's M tile the rows'
    next power of two from 16 up to the config's, the GEMV's
    tile shrunk to the register budget for m rows, and split_k resolved so every K chunk is whole
    tiles and none is empty. `min_block_k` is the kernels' smallest K tile (the 4-bit packing
    block, 32; the 8-bit kernels' 16-input run); `inputs_per_product` how many of a tile's inputs
    one live fp32 product covers (the 4-bit GEMV sums a byte's two nibbles into one: 2; 8-bit: 1),
    so a GEMV tile holds BLOCK_M x BLOCK_N x BLOCK_K / inputs_per_product <= GEMV_TILE_BUDGET.
    Raises ValueError on a bad path or block size."""
    path = path or ("gemv" if m <= gemv_max_m else "gemm")
    if path not in ("gemv", "gemm"):
        raise ValueError(f"path must be 'gemv' or 'gemm', not {path!r}")
    cfg = config or pick_config(_common.device_name(device), path, n, k, configs)
    block_n, block_k = cfg.block_n, cfg.block_k
    _common.check_blocks(minimum=min_block_k, block_k=block_k)
    if path == "gemv":
        _common.check_blocks(minimum=1, block_n=block_n)
        if m > gemv_max_m:
            raise ValueError(f"the GEMV path takes up to {gemv_max_m} rows, not {m}")
        block_m = _common.next_pow2(m)

        def products() -> int:
            return block_m * block_n * block_k // inputs_per_product

        # Keep the live fp32 products within the register budget.
        while products() > GEMV_TILE_BUDGET and block_k > min_block_k:
            block_k //= 2
        while products() > GEMV_TILE_BUDGET and block_n > 16:
            block_n //= 2
        m_blocks = 1
    else:
        _common.check_blocks(minimum=16, block_m=cfg.block_m, block_n=block_n)
        block_m = min(cfg.block_m, max(16, _common.next_pow2(m)))
        m_blocks = triton.cdiv(m, block_m)
    k_tiles = max(1, triton.cdiv(k, block_k))
    split = cfg.split_k or _auto_split(triton.cdiv(n, block_n) * m_blocks, k_tiles)
    split = max(1, min(split, k_tiles))
    k_chunk = triton.cdiv(k_tiles, split) * block_k
    split = max(1, triton.cdiv(k, k_chunk))  # no empty chunk: each writes its workspace slice
    return LaunchPlan(path, block_m, block_n, block_k, split, k_chunk, cfg.num_warps, cfg.num_stages)


def stepped(n: int, k: int, plan: LaunchPlan, group_size: int, super_size: int) -> bool:
    """Whether the 4-bit kernels load their tiles through `_stepped_bases` (STEPPED): every tile
    whole (N a multiple of the tile's rows, K of its inputs) and the tile and the groups (and
    super-blocks) nested, one a multiple of the other, so a run's group at the tile at k0 is
    k0 // G plus its own offset in the tile, and alike for super-blocks."""
    nested = lambda d: plan.block_k % d == 0 or d % plan.block_k == 0
    return (n % plan.block_n == 0 and k % plan.block_k == 0 and nested(group_size)
            and (super_size == 0 or nested(super_size)))


def check_activations(x: torch.Tensor, k: int, device: torch.device) -> torch.Tensor:
    """The launchers' checks of x against K inputs of weights on `device` (ValueError naming what
    is wrong); returns x with a unit column stride (a copy only where it had none)."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32, not {x.dtype}")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], not {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"x is on {x.device}, the weights on {device}")
    return x if x.stride(1) == 1 else x.contiguous()


def run_split_k(y: torch.Tensor, plan: LaunchPlan, tiles: int,
                launch: Callable[[torch.Tensor, torch.Tensor, int], None]) -> torch.Tensor:
    """Run a product kernel into y [M, N] by `plan`, one launch: `launch(out, counters,
    stride_ok)` launches it with SPLIT = plan.split_k > 1 over `tiles` output tiles. With one
    K chunk out is y itself (stride 0); else an fp32 workspace [split_k, M, N] (K chunk s at
    offset s * stride_ok) whose slices each tile's last program adds in chunk order into y, with
    `counters` (_common.zeroed_counters) counting the programs done per tile (see the module
    docstring: deterministic, no second launch, no zeroing launch). Returns y."""
    m, n = y.shape
    counters = _common.zeroed_counters(y.device, tiles if plan.split_k > 1 else 0)
    if plan.split_k == 1:
        launch(y, counters, 0)
        return y
    ws = torch.empty(plan.split_k, m, n, dtype=torch.float32, device=y.device)
    launch(ws, counters, ws.stride(0))
    return y


def check_gated(act: str | None) -> str:
    """The kernels' ACT for a call's `act`: "none" for None (x is the input), else `act` itself
    when it is a gated activation (x is then gate | up, [M, 2K]); ValueError otherwise."""
    if act is None:
        return "none"
    if act not in GATED_ACTIVATIONS:
        raise ValueError(f"act must be one of {GATED_ACTIVATIONS} or None, not {act!r}")
    return act


def w4a16_matmul(x: torch.Tensor, w: W4Weight, *, exact: bool = False, path: str | None = None,
                 config: KernelConfig | None = None, act: str | None = None) -> torch.Tensor:
    """y = x @ dequantize(w).T with the weights dequantized in the kernels; with `act`, x is a
    gate | up row block gu and y = act_mul(gu, act) @ dequantize(w).T, the gated activation
    computed as x is loaded. Semantics: see the module docstring.

    Args:
        x: [M, K] (with act: [M, 2K]) bf16 / fp16 / fp32 on w's device; any row stride, unit
            column stride.
        w: the 4-bit weights (fp16 or fp32 scales and mins, or two levels).
        exact: GEMM tiles in fp32 with IEEE products whatever x's dtype (fp32 x always is; the
            GEMV's products are always fp32).
        path: "gemv" or "gemm"; None picks by M (the GEMV for GEMV_MAX_M rows).
        config: launch parameters; None takes pick_config's for the device and shape.
        act: None, or "silu" / "gelu_tanh": the input is act(x[:, :K]) * x[:, K:] rounded to
            x's dtype, exactly what norms.silu_mul / gelu_tanh_mul give (norms.gated_act_mul).
    Returns:
        [M, N] in x's dtype, a new tensor.
    Raises:
        ValueError on a bad dtype, shape, device, layout, config or act; RuntimeError where this
        module's kernels cannot run on x's device (check_runnable).
    """
    gate = check_gated(act)
    x = check_activations(x, w.K * (1 if act is None else 2), w.device)
    m, n, k = x.shape[0], w.N, w.K
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    check_runnable(x.device)
    # The qweight rows are K/2 bytes (a multiple of 16) apart, so 16-byte alignment of the base
    # makes every row's tile loads aligned; a view at an odd offset would break that silently.
    if w.qweight.data_ptr() % 16:
        raise ValueError("qweight's data must start 16-byte aligned (a tensor of its own, not an offset view)")
    plan = launch_plan(m, n, k, x.device, path=path, config=config)
    # One level: the super-block factors are never read (SUPER 0); scales and mins stand in.
    two = w.super_size != 0
    ss, sm = (w.super_scales, w.super_mins) if two else (w.scales, w.mins)
    common = dict(G=w.group_size, SUPER=w.super_size // w.group_size, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
                  BLOCK_K=plan.block_k, SPLIT=plan.split_k > 1, ACT=gate,
                  STEPPED=stepped(n, k, plan, w.group_size, w.super_size), num_warps=plan.num_warps,
                  num_stages=plan.num_stages)
    n_blocks = triton.cdiv(n, plan.block_n)
    m_blocks = 1 if plan.path == "gemv" else triton.cdiv(m, plan.block_m)

    def launch(out: torch.Tensor, counters: torch.Tensor, stride_ok: int) -> None:
        args = (x, w.qweight, w.scales, w.mins, ss, sm, out, y, counters, m, n, k, plan.k_chunk, x.stride(0),
                w.qweight.stride(0), w.scales.stride(0), ss.stride(0) if two else 0, n, stride_ok)
        if plan.path == "gemv":
            _w4_gemv_kernel[(n_blocks, plan.split_k)](*args, **common)
        else:
            ieee = exact or _common.dot_in_fp32(x.dtype)
            _w4_gemm_kernel[(m_blocks, n_blocks, plan.split_k)](*args, IEEE=ieee, **common)

    return run_split_k(y, plan, m_blocks * n_blocks, launch)


# ----------------------------------------------------------------------------- module


def gated_permutation(perm: torch.Tensor) -> torch.Tensor:
    """An input permutation of K as one of a gate | up row of 2K (both halves permuted alike):
    gu[:, gated_permutation(perm)] = cat(gu[:, :K][:, perm], gu[:, K:][:, perm])."""
    return torch.cat([perm, perm + perm.numel()])


def device_copy(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """t on `device`, contiguous and starting 16-byte aligned (the kernels' vector loads need it;
    a row slice of a host tensor may start anywhere): copied only where it must be."""
    t = t.to(device).contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


class W4A16Linear(nn.Module):
    """A frozen base linear kept 4-bit on the device: `lin(x [T, in]) -> [T, out]` in x's dtype
    (the Backend.linear contract). Only the 4-bit weight (codes, scales, mins, and a
    QuantizedWeight's input permutation) lives on the device. `exact`: a reference module whose
    GEMM tiles multiply in fp32 with IEEE products (w4a16_matmul's `exact`), for parity runs."""

    def __init__(self, weight: torch.Tensor | QuantizedWeight, *, device: torch.device | str, dtype: torch.dtype,
                 group_size: int = DEFAULT_GROUP_SIZE, exact: bool = False):
        """weight: a float [out, in] tensor on the host, quantized at load with `group_size`
        (`quantize`); or a checkpoint's 4-bit QuantizedWeight, whose codes, scales and mins go
        to the device as they are (`from_quantized`; group_size is then the checkpoint's).
        dtype: the activations' dtype (forward's x). ValueError for an 8-bit QuantizedWeight
        (w8a16.W8A16Linear takes those) or a shape the format cannot hold."""
        super().__init__()
        perm = None
        if isinstance(weight, QuantizedWeight):
            packed = from_quantized(weight.to(device))  # the nibbles reordered where they will live
            perm = weight.perm
            self.source = weight.source or "4-bit"
        else:
            packed = quantize(weight, group_size)
            self.source = f"quantized g{group_size}"
        self.register_buffer("qweight", device_copy(packed.qweight, device))
        self.register_buffer("scales", device_copy(packed.scales, device))
        self.register_buffer("mins", device_copy(packed.mins, device))
        two = packed.super_size != 0
        self.register_buffer("super_scales", device_copy(packed.super_scales, device) if two else None)
        self.register_buffer("super_mins", device_copy(packed.super_mins, device) if two else None)
        self.super_size = packed.super_size
        self.register_buffer("perm", None if perm is None else perm.to(device))
        # forward_gated's gather of gate | up: the permutation applied to both halves.
        self.register_buffer("gated_perm", None if perm is None else gated_permutation(perm).to(device),
                             persistent=False)
        self.group_size = packed.group_size
        self.dtype = dtype
        self.exact = exact
        self.out_features, self.in_features = packed.N, packed.K

    @property
    def weight4(self) -> W4Weight:
        """The weight in the stored (permuted) input order: y = x[:, perm] @ dequantize(weight4).T."""
        return W4Weight(self.qweight, self.scales, self.mins, self.group_size, self.super_scales, self.super_mins,
                        self.super_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            # Act-order checkpoints: the codes' inputs are sorted by group, so x is read in that
            # order (one gather of the activations, T x K, before the kernel).
            x = x.index_select(1, self.perm)
        return w4a16_matmul(x, self.weight4, exact=self.exact)

    def forward_gated(self, gu: torch.Tensor, act: str) -> torch.Tensor:
        """forward(act_mul(gu, act)) in one kernel: gu [T, 2 in] (gate | up) -> [T, out] in gu's
        dtype, the gated activation ("silu" or "gelu_tanh") computed as the kernel loads its
        input, with the numerics of norms.silu_mul / gelu_tanh_mul (w4a16_matmul's `act`)."""
        if self.gated_perm is not None:
            gu = gu.index_select(1, self.gated_perm)
        return w4a16_matmul(gu, self.weight4, exact=self.exact, act=act)

    def extra_repr(self) -> str:
        order = ", act-order perm" if self.perm is not None else ""
        levels = f" x {self.super_scales.dtype} per {self.super_size}" if self.super_size else ""
        return (f"in={self.in_features}, out={self.out_features}, {self.source}{order}, "
                f"scales {self.scales.dtype}{levels}, activations {self.dtype}")
