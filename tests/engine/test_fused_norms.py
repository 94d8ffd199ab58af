"""The Triton norms (engine/backends/triton/norms.py) against engine.backends.torch_ops: RMSNorm,
residual add + RMSNorm (x updated in place), SiLU * up; and GeGLU's gelu_tanh * up against
torch's F.gelu(approximate="tanh") * up.

Every case runs on CPU tensors through the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), and on CUDA tensors with compiled kernels where a GPU is present
(`TRITON_INTERPRET=0 pytest tests/engine/test_fused_norms.py`); one process runs one of the two.
The interpreter's configuration reads at most 64 columns per tile, so widths past 64 take the
two-pass (norms) and multi-program (silu_mul, gelu_tanh_mul) paths.

Tolerances: fp32 1e-5; bf16 1.6e-2 relative, two of bf16's steps (8 mantissa bits): a 1-ulp
difference in fp32's rsqrt can flip a rounding to bf16, and the interpreter rounds fp32 -> bf16
toward zero where torch and the GPU round to nearest.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.backends import torch_ops
from engine.backends.triton import norms

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(0, 33), (1, 33), (5, 33), (3, 257), (2, 64)]  # T = 0, 1, odd; odd H; one and several tiles


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    rtol, atol = TOL[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu(), want, rtol=rtol, atol=atol)


def _inputs(T, H, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * 3).to(dtype)
    w = (1 + 0.5 * torch.randn(H, generator=g)).to(dtype)
    return x, w, g


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", SHAPES)
def test_rms_norm_matches_torch_ops(device, dtype, T, H):
    x, w, _ = _inputs(T, H, dtype, T * H)
    h = norms.rms_norm(x.to(device), w.to(device), 1e-5)
    _close(h, torch_ops.rms_norm(x, w, 1e-5))


def test_rms_norm_fp32_weight_with_bf16_activations(device):
    """The weight's dtype decides the normalized value's rounding, as torch_ops."""
    x, _, g = _inputs(3, 40, torch.bfloat16, 1)
    w = 1 + torch.randn(40, generator=g)
    _close(norms.rms_norm(x.to(device), w.to(device), 1e-6), torch_ops.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", SHAPES)
def test_add_rms_norm_updates_x_in_place(device, dtype, T, H):
    x, w, g = _inputs(T, H, dtype, T + H)
    a = torch.randn(T, H, generator=g).to(dtype)
    want_x, want_h = torch_ops.add_rms_norm(x, a, w, 1e-5)
    xd = x.to(device)
    got_x, got_h = norms.add_rms_norm(xd, a.to(device), w.to(device), 1e-5)
    assert got_x.data_ptr() == xd.data_ptr()
    if device.type == "cuda" or dtype == torch.float32:
        assert torch.equal(xd.cpu(), want_x)  # one rounding of x + a, as torch's
    else:
        # The interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest even, as torch):
        # within one bf16 step.
        torch.testing.assert_close(xd, want_x, rtol=2 ** -7, atol=0)
    _close(got_h, want_h)


def test_add_rms_norm_on_a_row_strided_view(device):
    """Rows need only be contiguous: a view of every other row is normalized and updated in
    place, the rows between untouched."""
    base, w, g = _inputs(6, 33, torch.float32, 7)
    a = torch.randn(3, 33, generator=g)
    want_x, want_h = torch_ops.add_rms_norm(base[::2], a, w, 1e-5)
    bd = base.to(device)
    _, h = norms.add_rms_norm(bd[::2], a.to(device), w.to(device), 1e-5)
    _close(h, want_h)
    torch.testing.assert_close(bd[::2].cpu(), want_x)
    assert torch.equal(bd[1::2].cpu(), base[1::2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I", [(0, 17), (1, 17), (5, 17), (3, 131)])
def test_silu_mul_matches_torch_ops(device, dtype, T, I):
    g = torch.Generator().manual_seed(T * I)
    gu = (torch.randn(T, 2 * I, generator=g) * 4).to(dtype)
    _close(norms.silu_mul(gu.to(device)), torch_ops.silu_mul(gu))


def _gelu_tanh_mul_reference(gu: torch.Tensor) -> torch.Tensor:
    """HF's GeGLU (Gemma's MLP) in torch, in gu's dtype: the activation rounded, then the product."""
    g, u = gu.chunk(2, dim=-1)
    return F.gelu(g, approximate="tanh") * u


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I", [(0, 17), (1, 17), (5, 17), (3, 131)])
def test_gelu_tanh_mul_matches_torch_gelu(device, dtype, T, I):
    g = torch.Generator().manual_seed(T * I + 1)
    gu = (torch.randn(T, 2 * I, generator=g) * 4).to(dtype)
    _close(norms.gelu_tanh_mul(gu.to(device)), _gelu_tanh_mul_reference(gu))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul_is_finite_at_extreme_gates(device, dtype):
    """Far into either tail the activation is 0 or the identity, never NaN or inf: there exp
    overflows to inf (x / (1 + inf) = -0), and x ** 3 does for |x| past 1e13 (within bf16's
    range)."""
    gate = torch.tensor([-3e38, -1e20, -1e4, -60.0, -9.0, -0.0, 0.0, 1e-30, 9.0, 60.0, 1e4, 1e20, 3e38])
    up = torch.linspace(-1, 1, gate.numel())
    gu = torch.cat([gate, up])[None].to(dtype)
    got = norms.gelu_tanh_mul(gu.to(device))
    assert torch.isfinite(got).all()
    _close(got, _gelu_tanh_mul_reference(gu))


def test_bad_shapes_are_refused(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match="weight"):
        norms.rms_norm(x, torch.ones(7, device=device), 1e-5)
    with pytest.raises(ValueError, match="contiguous rows"):
        norms.rms_norm(x.t(), torch.ones(2, device=device), 1e-5)
    with pytest.raises(ValueError, match="even"):
        norms.silu_mul(torch.randn(2, 7, device=device))
    with pytest.raises(ValueError, match="even"):
        norms.gelu_tanh_mul(torch.randn(2, 7, device=device))
