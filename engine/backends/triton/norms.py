"""RMSNorm, residual add + RMSNorm, and the gated MLP activations (SwiGLU, GeGLU) in Triton: one
pass over each row instead of torch's several element-wise ops, with the numerics of
engine.backends.torch_ops.

Semantics (statistics and activations in fp32 whatever the dtype, as torch_ops / HF's
LlamaRMSNorm):
    rms_norm(x, w, eps):        n = x.float() * rsqrt(mean(x.float() ** 2) + eps)
                                h = (w * n.to(w.dtype)).to(x.dtype)
    add_rms_norm(x, a, w, eps): x += a (in x's dtype, in place); return x, rms_norm(x, w, eps)
    silu_mul(gu):               g, u = gu[:, :I], gu[:, I:];  silu(g).to(dtype) * u  -> [T, I]
    gelu_tanh_mul(gu):          g, u as above;  gelu_tanh(g).to(dtype) * u           -> [T, I]
        gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))  (F.gelu(approximate="tanh"))
Each product is rounded to the output dtype once, as torch's element-wise ops on CPU and GPU do
(F.silu(g) * u and F.gelu(g, approximate="tanh") * u round the activation, then the product).
`gated_act_mul` is that computation for loaded values: the W4A16/W8A16 matmuls' gated input
(w4a16.py, the down projection) calls it too, so the fused and the unfused MLP agree bit for bit.

Both activations are x * sigmoid(z): silu with z = x, gelu_tanh with z = 2 sqrt(2/pi) (x +
0.044715 x^3), since 0.5 (1 + tanh(y)) = sigmoid(2 y). So one kernel serves both (a constexpr
picks z), and neither needs a tanh: Triton has no portable one (libdevice's does not run in the
interpreter), and x / (1 + exp(-z)) neither cancels for negative x (where 1 + tanh(y) would) nor
overflows (exp(-z) = inf gives -0.0, exp(-z) = 0 gives x).

One program per block of `rows` rows (norms; a row's sum of squares is its program's alone, and a
row is written only by its program, so no atomics) or per (block of rows, column block) (the
gated activations). Alignment: rows are read as contiguous runs from row * row_stride; Triton
specializes pointers on 16-byte alignment and strides on divisibility by 16 at launch, so rows of
H * itemsize bytes a multiple of 16 (every hidden size in use) get 16-byte vector loads; the gated
activations' up half starts I elements into the row (aligned when I * itemsize is a multiple of
16). Other sizes are read correctly, in narrower loads.

Runs on CUDA tensors (compiled) or on CPU tensors under the Triton interpreter
(TRITON_INTERPRET=1 when this module is imported); punica_kernels.kernels._common.check_runnable refuses a mismatch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from punica_kernels.kernels._common import check_blocks, common_device, device_name, next_pow2

#: How this module's kernels are named in errors.
_KERNELS = "engine.backends.triton.norms"


# Launch configurations, as data: key (device name, kernel, None) as in attention.KERNEL_CONFIGS
# (device name from torch.cuda, or "interpreter"; "default" for devices never tuned).
#   max_block: widest row read in one tile; wider rows take two passes of max_block columns
#     (norms) or several programs (gated_mul: silu_mul and gelu_tanh_mul). A norm tile of 8192 fp32 values over 8 warps is
#     32 values a thread, within the register budget.
#   The interpreter's small max_block sends the tests' odd sizes through the multi-tile path too.
#   rows: rows per program (a power of two). On a GPU one row is a program's worth of work at
#     real hidden sizes; the interpreter pays per program, so it takes 16 rows at a time (the
#     tests' odd row counts then cross a program's last, partial block of rows).
NORM_CONFIGS: dict[tuple[str, str, None], dict] = {
    ("default", "rms_norm", None): dict(max_block=8192, num_warps=8, rows=1),
    ("default", "gated_mul", None): dict(max_block=1024, num_warps=4, rows=1),
    ("interpreter", "rms_norm", None): dict(max_block=64, num_warps=4, rows=16),
    ("interpreter", "gated_mul", None): dict(max_block=64, num_warps=4, rows=16),
}


def norm_config(device: torch.device, kernel: str) -> dict:
    """The launch configuration of `kernel` on `device` (see NORM_CONFIGS)."""
    return NORM_CONFIGS.get((device_name(device), kernel, None)) or NORM_CONFIGS[("default", kernel, None)]


@triton.jit
def _row_tile(x_rows, a_rows, offs, mask, ADD: tl.constexpr):
    """Columns `offs` of the rows: x, or x + a rounded to x's dtype as torch's x + a is."""
    x = tl.load(x_rows + offs[None, :], mask=mask, other=0.0)
    if ADD:
        a = tl.load(a_rows + offs[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + a.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _store_normed(h_rows, w_ptr, offs, H, mask, x, r):
    """h = (w * (x * r).to(w's dtype)) in h's dtype for columns `offs` (r: each row's rsqrt)."""
    w = tl.load(w_ptr + offs, mask=offs < H, other=0.0)
    n = (x.to(tl.float32) * r[:, None]).to(w.dtype)
    tl.store(h_rows + offs[None, :], (n.to(tl.float32) * w.to(tl.float32)[None, :]).to(h_rows.dtype.element_ty),
             mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr, a_ptr, w_ptr, h_ptr, T, H, eps, stride_x, stride_a, stride_h,
    ADD: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr,
):
    # grid = (cdiv(T, ROWS),): rows [pid * ROWS, +ROWS), all H columns (one tile when SINGLE, else
    # BLOCK at a time). A row's statistics are reduced along axis 1 of its own tile row.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    row_ok = rows < T
    x_rows = x_ptr + rows[:, None] * stride_x
    a_rows = a_ptr + rows[:, None] * stride_a
    h_rows = h_ptr + rows[:, None] * stride_h
    if SINGLE:
        offs = tl.arange(0, BLOCK)
        mask = row_ok[:, None] & (offs < H)[None, :]
        x = _row_tile(x_rows, a_rows, offs, mask, ADD)
        if ADD:
            tl.store(x_rows + offs[None, :], x, mask=mask)
        xf = x.to(tl.float32)
        _store_normed(h_rows, w_ptr, offs, H, mask, x, tl.rsqrt(tl.sum(xf * xf, 1) / H + eps))
    else:
        # Pass 1: the sum of squares (of x + a when ADD; nothing stored yet). Pass 2 recomputes
        # x + a before storing it: reading back x after storing it would need a barrier
        # between the program's threads.
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for c0 in range(0, H, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            xf = _row_tile(x_rows, a_rows, offs, row_ok[:, None] & (offs < H)[None, :], ADD).to(tl.float32)
            acc += xf * xf
        r = tl.rsqrt(tl.sum(acc, 1) / H + eps)
        for c0 in range(0, H, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            mask = row_ok[:, None] & (offs < H)[None, :]
            x = _row_tile(x_rows, a_rows, offs, mask, ADD)
            if ADD:
                tl.store(x_rows + offs[None, :], x, mask=mask)
            _store_normed(h_rows, w_ptr, offs, H, mask, x, r)


#: 2 sqrt(2 / pi): gelu_tanh's sigmoid argument is this times x (1 + 0.044715 x^2).
_GELU_2C = tl.constexpr(1.5957691216057308)


@triton.jit
def gated_act_mul(g, u, ACT: tl.constexpr):
    """act(g) * u in g's dtype, elementwise (the Semantics above): act in fp32, rounded to the
    dtype, then the product in fp32, rounded again. ACT: "silu" or "gelu_tanh" (compile-time:
    each activation is its own build, no branch). The one definition of the gated activation's
    numerics: the kernel below and the W4A16/W8A16 matmuls' gated input (w4a16.py) call it, so a
    fused down projection reads exactly the values silu_mul / gelu_tanh_mul would write."""
    gf = g.to(tl.float32)
    # act(x) = x * sigmoid(z) (module docstring); rounded to the dtype, as F.silu / F.gelu.
    if ACT == "gelu_tanh":
        z = _GELU_2C * gf * (1.0 + 0.044715 * gf * gf)
    else:
        z = gf
    a = (gf / (1.0 + tl.exp(-z))).to(g.dtype)
    return (a.to(tl.float32) * u.to(tl.float32)).to(g.dtype)


@triton.jit
def _gated_mul_kernel(gu_ptr, out_ptr, T, I, stride_gu, stride_o,
                      ACT: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # grid = (cdiv(T, ROWS), cdiv(I, BLOCK)): columns [pid1 * BLOCK, +BLOCK) of rows [pid0 * ROWS, +ROWS).
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < T)[:, None] & (offs < I)[None, :]
    g_ptrs = gu_ptr + rows[:, None] * stride_gu + offs[None, :]
    g = tl.load(g_ptrs, mask=mask, other=0.0)
    u = tl.load(g_ptrs + I, mask=mask, other=0.0)
    tl.store(out_ptr + rows[:, None] * stride_o + offs[None, :], gated_act_mul(g, u, ACT), mask=mask)


def _check_rows(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be 2-D [T, H] with contiguous rows, got shape {tuple(t.shape)}")


def _launch_norm(x, a, weight, eps, h) -> None:
    T, H = x.shape
    if T == 0 or H == 0:
        return
    cfg = norm_config(x.device, "rms_norm")
    check_blocks(max_block=cfg["max_block"])
    block = min(next_pow2(H), cfg["max_block"])
    rows = cfg["rows"]
    _rms_norm_kernel[(triton.cdiv(T, rows),)](
        x, a if a is not None else x, weight, h, T, H, float(eps),
        x.stride(0), a.stride(0) if a is not None else 0, h.stride(0),
        ADD=a is not None, ROWS=rows, BLOCK=block, SINGLE=block >= H, num_warps=cfg["num_warps"],
    )


def _check_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.device:
    _check_rows("x", x)
    if weight.shape != (x.shape[1],) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{x.shape[1]}], got {tuple(weight.shape)}")
    return common_device(x, weight, what=_KERNELS)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] (rows contiguous), weight [H] -> h [T, H] in x's dtype. Semantics: module docstring."""
    device = _check_norm(x, weight)
    h = torch.empty(x.shape, dtype=x.dtype, device=device)
    _launch_norm(x, None, weight, eps, h)
    return h


def add_rms_norm(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x += a in place (the residual stream), then (x, rms_norm(x)). x, a: [T, H], same dtype,
    rows contiguous; a must not overlap x."""
    device = _check_norm(x, weight)
    _check_rows("a", a)
    if a.shape != x.shape or a.dtype != x.dtype:
        raise ValueError(f"a must match x: {a.dtype} {tuple(a.shape)} vs {x.dtype} {tuple(x.shape)}")
    common_device(x, a, what=_KERNELS)
    h = torch.empty(x.shape, dtype=x.dtype, device=device)
    _launch_norm(x, a, weight, eps, h)
    return x, h


#: The gated activations `gated_act_mul` computes (ModelConfig.hidden_act values).
GATED_ACTIVATIONS = ("silu", "gelu_tanh")


def _gated_mul(gu: torch.Tensor, act: str) -> torch.Tensor:
    _check_rows("gu", gu)
    if gu.shape[1] % 2:
        raise ValueError(f"gu's width must be even (gate | up), got {gu.shape[1]}")
    device = common_device(gu, what=_KERNELS)
    T, I = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(T, I, dtype=gu.dtype, device=device)
    if T == 0 or I == 0:
        return out
    cfg = norm_config(device, "gated_mul")
    check_blocks(max_block=cfg["max_block"])
    block = min(next_pow2(I), cfg["max_block"])
    rows = cfg["rows"]
    _gated_mul_kernel[(triton.cdiv(T, rows), triton.cdiv(I, block))](
        gu, out, T, I, gu.stride(0), out.stride(0), ACT=act, ROWS=rows, BLOCK=block, num_warps=cfg["num_warps"])
    return out


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2I] (gate | up, rows contiguous) -> silu(gate) * up [T, I] in gu's dtype (SwiGLU)."""
    return _gated_mul(gu, "silu")


def gelu_tanh_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2I] (gate | up, rows contiguous) -> gelu_tanh(gate) * up [T, I] in gu's dtype (GeGLU,
    Gemma's MLP: F.gelu(gate, approximate="tanh") * up). Semantics: module docstring."""
    return _gated_mul(gu, "gelu_tanh")
