"""W8A16: 8-bit base weights on the device, multiplied by 16-bit (or fp32) activations with the
weights dequantized inside the Triton kernels, so an 8-bit checkpoint (GGUF Q8_0, the K-quants
whose codes fit in 8 bits, GPTQ 8-bit, compressed-tensors W8A16 and FP8) stays 8-bit on the GPU.

Semantics:
    # w: an 8-bit engine.loader.quantized.QuantizedWeight, N x K, groups of G inputs along K
    Wp[n, k] = value(codes[n, k]) * scale[n, k // G] (+ min[n, k // G])     # fp32
    # value: the integer -128..127, or (code_format "e4m3") the FP8 E4M3 number the byte encodes
    one level:  scale = scales, min = mins
    two levels (super_size S, R = S // G groups a super-block; a K-quant's own form):
        scale[n, g] = super_scales[n, g // R] * scales[n, g]       # fp32; scales uint8 or int8
        min[n, g]   = super_mins[n, g // R] * mins[n, g]
    y[m, :] = x[m, perm] @ Wp.T                                       # = x @ w.dequantize().T
    # fp32 accumulation, y in x's dtype; perm None: x as it is
    # gated (act; x = gu [M, 2K], gate | up): x = norms' act_mul(gu, act), as in w4a16

The format is QuantizedWeight's own (bits 8), read as it is:
- `codes` int8 [N, K], contiguous: each row is K bytes, so with K a multiple of 16 (every served
  model's) and a 16-byte aligned base (the launcher checks it) every 16-input run of a row loads
  as one 16-byte vector. Other K are served, with narrower loads.
- `scales` (and `mins`) fp16 or fp32 [N, ceil(K / G)], G a multiple of 16, so a 16-input run
  always shares one group: the kernels load one scale (and min) a run, in the stored dtype, and
  widen it to fp32. A per-channel scale is G = K. Without mins (symmetric formats) the kernels
  are built with HAS_MIN off and read no mins at all.
- Two levels (`super_size` S > 0, a multiple of G; the GGUF K-quants Q2_K, Q3_K, Q5_K, Q6_K):
  `scales` (and `mins`) uint8 or int8 [N, ceil(K / G)], the file's integer sub-block values, and
  `super_scales` (and `super_mins`) fp16 or fp32 [N, ceil(K / S)], its d (and -dmin) per
  super-block. The kernels (built with SUPER = S / G) load a run's sub-block value and its
  super-block's factor and multiply them in fp32: with fp16 factors the product is exact (an
  11-bit significand times an 8-bit integer), so every weight is bit for bit the one-level fp32
  form's (QuantizedWeight.one_level()), for 1 byte a group and 2 a super-block instead of 4 a
  group, for each of scale and min (Q6_K: 8.5625 bits a weight instead of 10). Where there are
  mins (Q5_K, Q2_K) code x scale is exact too, so however a GPU build fuses the multiplies and
  the add, each weight rounds once, as the reference does. A super-block may span K tiles and K
  chunks, and a tile may span super-blocks: a tile inside one reads one factor a row, any other
  one factor a run.
- `code_format` "e4m3" (FP8 checkpoints): the codes are FP8 E4M3 bit patterns, decoded in the
  kernels into the value each encodes (`_e4m3_value`), then scaled as integer codes are: by the
  GPU's FP8 conversion where it has one (compute capability 8.9 and up; the interpreter), else by
  moving the bits into an fp16's place (exact, subnormals included), its 2^-8 folded into the
  run's scale (`fp8_conversion`). Either gives the same bits.
- `perm` (GPTQ act-order): x is gathered through it once a call (T x K elements) before the
  kernel, which then reads the codes in their stored order.

Kernels (`w8a16_matmul`), the two paths of w4a16.py with 8-bit tiles, sharing its launch plan
(`w4a16.launch_plan`: the path by M, the GEMV tile shrunk to the register budget, split-K into
whole nonempty chunks), its split-K store (`w4a16.split_k_store`, `run_split_k`: each K chunk's
partial sums in its own slice of an fp32 workspace, added in chunk order by each output tile's
last program, in the same launch, the same bits on every run), its gated input
(`w4a16.load_input`: act(gate) * up computed as loaded, for the MLP's down projection) and its
activation checks:
- M <= GEMV_MAX_M (one row): split-K GEMV on the CUDA cores. Each program dequantizes a
  BLOCK_N x BLOCK_K tile once (16-byte loads of codes, one scale a 16-input run) and multiplies
  it by the row (fp32 products and accumulation). The kernel takes up to 16 rows, but its cost
  grows with each row (every product is a CUDA-core FMA), so wider goes to the GEMM.
- wider: tiled GEMM on the tensor cores (tl.dot), the M tile the rows' next power of two from
  16, K split while the grid is small: tiles dequantized to x's dtype (fp32 tiles with IEEE
  products for fp32 activations, for `exact=True`, and for bf16 under the interpreter, whose
  bf16 tl.dot is wrong).
Block sizes come from this module's `CONFIGS` (same keys as w4a16's).

Where the kernels run: as w4a16's (TRITON_INTERPRET at import; `w4a16.check_runnable`).
`dequantize` (QuantizedWeight.dequantize) is the reference and runs anywhere.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from engine.backends.triton.w4a16 import (KernelConfig, LaunchPlan, check_activations, check_gated, check_runnable,
                                          device_copy, gated_permutation, launch_plan, load_input, run_split_k,
                                          split_k_store)
from engine.loader.quantized import QuantizedWeight
from punica_kernels.kernels import _common

#: Inputs per run: one 16-byte vector of codes, one scale (G % 16 == 0).
RUN = 16
#: Widest M the split-K GEMV path takes by default (a decode step of one sequence); wider goes to
#: the tensor-core GEMM, whose time barely grows up to its 16-row tile. The kernel itself takes
#: up to GEMV_KERNEL_MAX_M rows (`path="gemv"`).
GEMV_MAX_M = 1
GEMV_KERNEL_MAX_M = 16

#: (device name, path, N, K) -> config, as w4a16.CONFIGS.
CONFIGS: dict[tuple[str, str, int, int], KernelConfig] = {
    # GEMV: 32 rows x 128 inputs a tile: 128 bytes of each row (eight 16-byte loads), as the
    # 4-bit GEMV's default tile reads, with the same 8192 live fp32 products.
    ("default", "gemv", 0, 0): KernelConfig(block_n=32, block_k=128, split_k=0, num_warps=4, num_stages=2),
    ("default", "gemm", 0, 0): KernelConfig(block_n=64, block_k=64, split_k=0, block_m=64, num_warps=4, num_stages=3),
}


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """The reference: fp32 [N, K] in the original input order (QuantizedWeight.dequantize)."""
    return w.dequantize()


def plan(m: int, n: int, k: int, device: torch.device, *, path: str | None = None,
         config: KernelConfig | None = None) -> LaunchPlan:
    """The launch for an [m, k] x [n, k].T product of 8-bit weights (w4a16.launch_plan with this
    module's configs, 16-input runs, one input per live product)."""
    path = path or ("gemv" if m <= GEMV_MAX_M else "gemm")
    return launch_plan(m, n, k, device, path=path, config=config, configs=CONFIGS, min_block_k=RUN,
                       inputs_per_product=1, gemv_max_m=GEMV_KERNEL_MAX_M)


# ----------------------------------------------------------------------------- kernels


#: `CODES` of the kernels: integer codes, or E4M3 codes decoded by bit moves or by the hardware.
CODES_INT, CODES_E4M3_BITS, CODES_E4M3_HW = 0, 1, 2


@triton.jit
def _e4m3_value(q, CODES: tl.constexpr):
    """fp32 of FP8 E4M3 bit patterns `q` (int8; never NaN). CODES_E4M3_HW: the value, by the
    GPU's FP8 conversion. CODES_E4M3_BITS: the value x 2^-8, exactly: the sign and the 7 exponent
    and mantissa bits moved into an fp16's places (E4M3's bias 7 is fp16's 15 less 8, and its
    subnormals land on fp16 subnormals), then widened; the caller's scale carries the 2^8."""
    if CODES == 2:
        return q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    u = q.to(tl.int32) & 0xFF
    h = ((u & 0x7F) << 7) | ((u & 0x80) << 8)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_runs(q_ptr, s_ptr, m_ptr, ss_ptr, sm_ptr, rows, mask_n, k0, K, stride_q, stride_s, stride_ss,
                  G: tl.constexpr, SUPER: tl.constexpr, NR: tl.constexpr, HAS_MIN: tl.constexpr,
                  CODES: tl.constexpr):
    """fp32 weights of one K tile of NR runs of 16 inputs as [BLOCK_N, NR, 16], with the input
    index of each [NR, 16] and its mask (inside K). Run r holds inputs k0 + 16 r + j, j < 16.
    Scales and mins load once a run ([BLOCK_N, NR]), not once a weight. SUPER > 0 (two levels,
    SUPER groups a super-block): a run's scale (and min) is its group's integer value times its
    super-block's factor (ss_ptr, sm_ptr; row stride stride_ss), exact in fp32; SUPER 0 reads
    neither."""
    r = tl.arange(0, NR)
    j = tl.arange(0, 16)
    # Alignment of the code loads: k0 is a multiple of the K tile (chunks and steps are whole
    # tiles of a multiple of 16 inputs) and rows are K bytes apart from a 16-byte aligned base;
    # where K % 16 == 0 (Triton specializes on it) the mask is constant over each run too, so
    # each run's 16 bytes load as one vector.
    k0 = tl.multiple_of(k0, 16)
    e = k0 + r[:, None] * 16 + j[None, :]  # [NR, 16]
    mask_e = e < K
    q = tl.load(q_ptr + rows[:, None, None] * stride_q + e[None, :, :],
                mask=mask_n[:, None, None] & mask_e[None, :, :], other=0)
    g = (k0 + r * 16) // G  # G % 16 == 0: a run's 16 inputs share one group
    s_off = rows[:, None] * stride_s + g[None, :]
    mask_s = mask_n[:, None] & ((k0 + r * 16) < K)[None, :]
    if SUPER > 0:
        if (SUPER * G) % (NR * 16) == 0:
            # k0 is a multiple of the tile's NR * 16 inputs, which divide a super-block: the
            # whole tile lies in super-block k0 // (SUPER G), one factor a row (a super-block
            # may still span tiles and K chunks).
            f_off = rows[:, None] * stride_ss + k0 // (SUPER * G)
            f_mask = mask_n[:, None]
        else:
            # A tile may span super-blocks (wider than one, or straddling two): each run its own.
            f_off = rows[:, None] * stride_ss + (g // SUPER)[None, :]
            f_mask = mask_s
        sc = (tl.load(s_ptr + s_off, mask=mask_s, other=0).to(tl.float32)
              * tl.load(ss_ptr + f_off, mask=f_mask, other=0.0).to(tl.float32))[:, :, None]
    else:
        sc = tl.load(s_ptr + s_off, mask=mask_s, other=0.0).to(tl.float32)[:, :, None]
    if CODES == 0:
        w = q.to(tl.float32) * sc
    elif CODES == 1:
        w = _e4m3_value(q, CODES) * (sc * 256.0)  # exact: a power of two; one rounding, as below
    else:
        w = _e4m3_value(q, CODES) * sc
    if HAS_MIN:
        if SUPER > 0:
            w += (tl.load(m_ptr + s_off, mask=mask_s, other=0).to(tl.float32)
                  * tl.load(sm_ptr + f_off, mask=f_mask, other=0.0).to(tl.float32))[:, :, None]
        else:
            w += tl.load(m_ptr + s_off, mask=mask_s, other=0.0).to(tl.float32)[:, :, None]
    return w, e, mask_e


@triton.jit
def _w8_gemv_kernel(
    x_ptr, q_ptr, s_ptr, m_ptr, ss_ptr, sm_ptr, out_ptr, y_ptr, cnt_ptr,
    M, N, K, K_CHUNK, stride_xm, stride_q, stride_s, stride_ss, stride_om, stride_ok,
    G: tl.constexpr, SUPER: tl.constexpr, HAS_MIN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, ACT: tl.constexpr, CODES: tl.constexpr,
):
    # grid = (cdiv(N, BLOCK_N), SPLIT_K); program (n, s) computes K chunk s of output tile n, all
    # M rows (w4a16.split_k_store).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)  # row * stride must not wrap at 2^31 bytes
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * K_CHUNK  # K_CHUNK % BLOCK_K == 0: tiles never straddle two chunks
    k_end = tl.minimum(k_start + K_CHUNK, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        w, e, mask_e = _dequant_runs(q_ptr, s_ptr, m_ptr, ss_ptr, sm_ptr, rows, mask_n, k0, K, stride_q, stride_s,
                                     stride_ss, G, SUPER, BLOCK_K // 16, HAS_MIN, CODES)
        # x is small and shared by all programs (L2); nothing is assumed of its row stride.
        xt = load_input(x_ptr, offs_m[:, None, None] * stride_xm + e[None, :, :],
                     mask_m[:, None, None] & mask_e[None, :, :], K, ACT).to(tl.float32)
        prod = xt[:, None, :, :] * w[None, :, :, :]
        acc += tl.sum(tl.sum(prod, axis=3), axis=2)
    split_k_store(acc, 0, offs_m[:, None] * stride_om + offs_n[None, :], mask_m[:, None] & mask_n[None, :], pid_n,
                  pid_k, tl.num_programs(1), out_ptr, y_ptr, cnt_ptr, stride_ok, SPLIT)


@triton.jit
def _w8_gemm_kernel(
    x_ptr, q_ptr, s_ptr, m_ptr, ss_ptr, sm_ptr, out_ptr, y_ptr, cnt_ptr,
    M, N, K, K_CHUNK, stride_xm, stride_q, stride_s, stride_ss, stride_om, stride_ok,
    G: tl.constexpr, SUPER: tl.constexpr, HAS_MIN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, SPLIT: tl.constexpr, ACT: tl.constexpr, CODES: tl.constexpr,
):
    # grid = (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), SPLIT_K); program (m, n, s) computes K chunk s
    # of output tile (m, n) (w4a16.split_k_store). M blocks vary fastest: programs running
    # together share weight tiles.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_m = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    p = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * K_CHUNK
    k_end = tl.minimum(k_start + K_CHUNK, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        w3, _, _ = _dequant_runs(q_ptr, s_ptr, m_ptr, ss_ptr, sm_ptr, rows, mask_n, k0, K, stride_q, stride_s,
                                 stride_ss, G, SUPER, BLOCK_K // 16, HAS_MIN, CODES)
        # [BLOCK_N, NR, 16] -> [BLOCK_K, BLOCK_N]: flattened in input order, transposed for tl.dot.
        w = tl.trans(tl.reshape(w3, (BLOCK_N, BLOCK_K)))
        e = k0 + p
        xt = load_input(x_ptr, offs_m[:, None] * stride_xm + e[None, :], mask_m[:, None] & (e < K)[None, :], K, ACT)
        if IEEE:
            acc += tl.dot(xt.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(xt, w.to(xt.dtype))
    tile = pid_n * tl.num_programs(0) + pid_m
    base = pid_m.to(tl.int64) * BLOCK_M * stride_om
    offs = tl.arange(0, BLOCK_M)[:, None] * stride_om + offs_n[None, :]  # < BLOCK_M x N: 32 bits
    split_k_store(acc, base, offs, mask_m[:, None] & mask_n[None, :], tile, pid_k, tl.num_programs(2), out_ptr, y_ptr,
                  cnt_ptr, stride_ok, SPLIT)


# ----------------------------------------------------------------------------- launcher


def fp8_conversion(device: torch.device) -> str:
    """How the kernels decode E4M3 codes on `device`: "hardware" (FP8 conversion instructions:
    compute capability 8.9 and up, and the interpreter) or "bits" (any GPU)."""
    if device.type == "cuda":
        return "hardware" if torch.cuda.get_device_capability(device) >= (8, 9) else "bits"
    return "hardware"


def _check_weight(w: QuantizedWeight) -> None:
    if not isinstance(w, QuantizedWeight) or w.bits != 8:
        what = f"a {w.bits}-bit QuantizedWeight" if isinstance(w, QuantizedWeight) else type(w).__name__
        raise ValueError(f"the W8A16 kernels take 8-bit QuantizedWeights, not {what}")
    parts = {"scales": w.scales, "mins": w.mins, "super_scales": w.super_scales, "super_mins": w.super_mins,
             "perm": w.perm}
    for name, t in parts.items():
        if t is not None and t.device != w.codes.device:
            raise ValueError(f"{name} is on {t.device}, codes on {w.codes.device}")
    if not all(t.is_contiguous() for t in (w.codes, w.scales, w.mins, w.super_scales, w.super_mins) if t is not None):
        raise ValueError("codes, scales and mins (and super-block factors) must be contiguous")
    # Rows are K bytes apart: 16-byte alignment of the base keeps every run's vector load aligned
    # (where K % 16 == 0); a view at an odd offset would break that silently.
    if w.codes.data_ptr() % 16:
        raise ValueError("codes' data must start 16-byte aligned (a tensor of its own, not an offset view)")


def w8a16_matmul(x: torch.Tensor, w: QuantizedWeight, *, exact: bool = False, path: str | None = None,
                 config: KernelConfig | None = None, act: str | None = None,
                 fp8: str | None = None) -> torch.Tensor:
    """y = x @ w.dequantize().T with the 8-bit weights dequantized in the kernels; with `act`, x is
    a gate | up row block gu and y = act_mul(gu, act) @ w.dequantize().T, the gated activation
    computed as x is loaded. Semantics: see the module docstring.

    Args:
        x: [M, K] (with act: [M, 2K]) bf16 / fp16 / fp32 on w's device; any row stride, unit
            column stride.
        w: an 8-bit QuantizedWeight (contiguous tensors on one device; mins and perm optional;
            one level or two).
        exact: GEMM tiles in fp32 with IEEE products whatever x's dtype (the GEMV always is).
        path: "gemv" (up to GEMV_KERNEL_MAX_M rows) or "gemm"; None picks by M (GEMV up to
            GEMV_MAX_M rows).
        config: launch parameters; None takes this module's CONFIGS for the device and shape.
        act: None, or "silu" / "gelu_tanh": the input is act(x[:, :K]) * x[:, K:] rounded to
            x's dtype, as w4a16_matmul's `act` (the numerics of norms.silu_mul / gelu_tanh_mul).
        fp8: for E4M3 codes, "hardware" or "bits" (module docstring); None: `fp8_conversion`.
    Returns:
        [M, N] in x's dtype, a new tensor.
    Raises:
        ValueError on a bad weight, dtype, shape, device, layout, config or act; RuntimeError
        where the kernels cannot run on x's device (w4a16.check_runnable).
    """
    _check_weight(w)
    gate = check_gated(act)
    x = check_activations(x, w.K * (1 if act is None else 2), w.codes.device)
    m, n, k = x.shape[0], w.N, w.K
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    check_runnable(x.device, "the W8A16")
    codes = CODES_INT
    if w.code_format == "e4m3":
        fp8 = fp8 or fp8_conversion(x.device)
        if fp8 not in ("hardware", "bits"):
            raise ValueError(f"fp8 must be 'hardware' or 'bits', not {fp8!r}")
        codes = CODES_E4M3_HW if fp8 == "hardware" else CODES_E4M3_BITS
    lp = plan(m, n, k, x.device, path=path, config=config)
    if w.perm is not None:
        x = x.index_select(1, w.perm if act is None else gated_permutation(w.perm))
    has_min = w.mins is not None
    two = w.super_size != 0
    common = dict(G=w.group_size, SUPER=w.super_size // w.group_size, HAS_MIN=has_min, BLOCK_M=lp.block_m,
                  BLOCK_N=lp.block_n, BLOCK_K=lp.block_k, SPLIT=lp.split_k > 1, ACT=gate, CODES=codes,
                  num_warps=lp.num_warps, num_stages=lp.num_stages)
    n_blocks = triton.cdiv(n, lp.block_n)
    m_blocks = 1 if lp.path == "gemv" else triton.cdiv(m, lp.block_m)
    # The kernels never read what they are not built for (m_ptr with HAS_MIN off; ss_ptr and
    # sm_ptr with SUPER 0, sm_ptr without mins): the scales stand in.
    mins = w.mins if has_min else w.scales
    ss = w.super_scales if two else w.scales
    sm = w.super_mins if two and has_min else ss

    def launch(out: torch.Tensor, counters: torch.Tensor, stride_ok: int) -> None:
        args = (x, w.codes, w.scales, mins, ss, sm, out, y, counters, m, n, k, lp.k_chunk, x.stride(0),
                w.codes.stride(0), w.scales.stride(0), ss.stride(0) if two else 0, n, stride_ok)
        if lp.path == "gemv":
            _w8_gemv_kernel[(n_blocks, lp.split_k)](*args, **common)
        else:
            ieee = exact or _common.dot_in_fp32(x.dtype)
            _w8_gemm_kernel[(m_blocks, n_blocks, lp.split_k)](*args, IEEE=ieee, **common)

    return run_split_k(y, lp, m_blocks * n_blocks, launch)


# ----------------------------------------------------------------------------- module


class W8A16Linear(nn.Module):
    """A frozen base linear kept 8-bit on the device: `lin(x [T, in]) -> [T, out]` in x's dtype
    (the Backend.linear contract). Only the checkpoint's codes, scales, mins (where the format
    has them), super-block factors (two levels) and input permutation (where it has one) live on
    the device, as loaded. `exact`: a reference module (w8a16_matmul's `exact` GEMM tiles), for
    parity runs."""

    def __init__(self, qw: QuantizedWeight, *, device: torch.device | str, dtype: torch.dtype, exact: bool = False):
        """qw: an 8-bit QuantizedWeight on the host; dtype: the activations' dtype (forward's x).
        ValueError for another bit width (w4a16.W4A16Linear takes 4-bit weights)."""
        super().__init__()
        if not isinstance(qw, QuantizedWeight) or qw.bits != 8:
            what = f"a {qw.bits}-bit QuantizedWeight" if isinstance(qw, QuantizedWeight) else type(qw).__name__
            raise ValueError(f"W8A16Linear takes an 8-bit QuantizedWeight, not {what}")
        self.register_buffer("codes", device_copy(qw.codes, device))
        self.register_buffer("scales", device_copy(qw.scales, device))
        self.register_buffer("mins", None if qw.mins is None else device_copy(qw.mins, device))
        two = qw.super_size != 0
        self.register_buffer("super_scales", device_copy(qw.super_scales, device) if two else None)
        self.register_buffer("super_mins", device_copy(qw.super_mins, device) if two and qw.mins is not None else None)
        self.super_size = qw.super_size
        self.register_buffer("perm", None if qw.perm is None else qw.perm.to(device))
        self.group_size = qw.group_size
        self.code_format = qw.code_format
        self.source = qw.source or "8-bit"
        self.dtype = dtype
        self.exact = exact
        self.out_features, self.in_features = qw.N, qw.K

    @property
    def weight8(self) -> QuantizedWeight:
        """The weight as the kernels read it (dequantize(weight8) is the layer's fp32 weight)."""
        return QuantizedWeight(8, self.codes, self.scales, self.mins, self.group_size, self.perm, self.source,
                               self.code_format, self.super_scales, self.super_mins, self.super_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return w8a16_matmul(x, self.weight8, exact=self.exact)

    def forward_gated(self, gu: torch.Tensor, act: str) -> torch.Tensor:
        """forward(act_mul(gu, act)) in one kernel: gu [T, 2 in] (gate | up) -> [T, out] in gu's
        dtype, the gated activation ("silu" or "gelu_tanh") computed as the kernel loads its
        input, with the numerics of norms.silu_mul / gelu_tanh_mul (w8a16_matmul's `act`)."""
        return w8a16_matmul(gu, self.weight8, exact=self.exact, act=act)

    def extra_repr(self) -> str:
        order = ", act-order perm" if self.perm is not None else ""
        mins = "" if self.mins is not None else ", no mins"
        codes = "" if self.code_format == "int" else f", {self.code_format} codes"
        levels = f" x {self.super_scales.dtype} per {self.super_size}" if self.super_size else ""
        return (f"in={self.in_features}, out={self.out_features}, {self.source} g{self.group_size}{order}{codes}, "
                f"scales {self.scales.dtype}{levels}{mins}, activations {self.dtype}")
