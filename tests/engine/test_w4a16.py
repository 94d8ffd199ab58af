"""The W4A16 format and kernels (engine/backends/triton/w4a16.py): GGUF blocks, a checkpoint's
QuantizedWeight (fp16 or fp32 scales, an act-order permutation) and load-time quantization
dequantize to what they should, and the Triton matmul on 4-bit weights equals
dequantize-then-matmul. Kernels run on CPU tensors through the Triton interpreter here, on CUDA
tensors compiled where a GPU is present (`TRITON_INTERPRET=0 pytest ...`; see
tests/conftest.py's `device` fixture)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from engine.backends.triton import norms, w4a16
from engine.backends.triton.w4a16 import (KernelConfig, W4A16Linear, dequantize, from_quantized, pack_gguf, quantize,
                                          w4a16_matmul)
from engine.loader.quantized import QuantizedWeight
from punica_kernels.kernels import _common

QTYPES = {"q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1}


def random_gguf_rows(qtype: str, n: int, k: int, seed: int, min_exp: int = -6) -> torch.Tensor:
    """uint8 [n, k/32 * block bytes]: random nibbles, signed fp16 scales (and mins) of mixed size,
    the scales' magnitudes spread over 10^min_exp .. 1."""
    rng = np.random.default_rng(seed)
    kb = k // 32
    d = (rng.standard_normal((n, kb, 1)) * 10.0 ** rng.integers(min_exp, 1, (n, kb, 1))).astype(np.float16)
    parts = [d.view(np.uint8)]
    if qtype == "q4_1":
        parts.append((rng.standard_normal((n, kb, 1)) * 0.1).astype(np.float16).view(np.uint8))
    parts.append(rng.integers(0, 256, (n, kb, 16), dtype=np.uint8))
    return torch.from_numpy(np.concatenate(parts, axis=-1).reshape(n, -1).copy())


def random_k_quant(n: int, k: int, seed: int, min_exp: int = -6) -> w4a16.W4Weight:
    """A Q4_K-like weight, group 32: scale = d x sc and min = -dmin x m per group (fp16 d and dmin
    of 10^min_exp .. 1, 6-bit sc and m), products exact in fp32 and most not representable in
    fp16 (11 + 6 significant bits); random nibbles."""
    gen = torch.Generator().manual_seed(seed)
    groups = k // 32
    def fp16_scale() -> torch.Tensor:
        exp = torch.randint(min_exp, 1, (n, groups), generator=gen)
        return ((0.5 + torch.rand(n, groups, generator=gen)) * 10.0 ** exp).half().float()

    d, dmin = fp16_scale(), fp16_scale()
    sc = torch.randint(0, 64, (n, groups), generator=gen)
    m = torch.randint(0, 64, (n, groups), generator=gen)
    codes = torch.randint(0, 256, (n, k // 2), generator=gen).to(torch.uint8)
    return w4a16.W4Weight(codes, d * sc, -dmin * m, 32)


def random_two_level(n: int, k: int, seed: int, super_size: int = 256, min_exp: int = -6) -> QuantizedWeight:
    """A Q4_K-like QuantizedWeight in the two-level form (group 32): uint8 6-bit sub-scales and
    sub-mins, fp16 d and -dmin per `super_size` inputs (of 10^min_exp .. 1, both signs, one zero
    d); K need not be whole super-blocks (the last one partial). Random nibbles."""
    gen = torch.Generator().manual_seed(seed)
    groups, supers = -(-k // 32), -(-k // super_size)

    def fp16_factor() -> torch.Tensor:
        exp = torch.randint(min_exp, 1, (n, supers), generator=gen)
        sign = torch.randint(0, 2, (n, supers), generator=gen) * 2 - 1
        return (sign * (0.5 + torch.rand(n, supers, generator=gen)) * 10.0 ** exp).half()

    d, dmin = fp16_factor(), fp16_factor()
    d[0, 0] = 0.0
    sc = torch.randint(0, 64, (n, groups), generator=gen).to(torch.uint8)
    m = torch.randint(0, 64, (n, groups), generator=gen).to(torch.uint8)
    codes = torch.randint(0, 256, (n, k // 2), generator=gen).to(torch.uint8)
    return QuantizedWeight(4, codes, sc, m, 32, source="gguf q4_k", super_scales=d, super_mins=-dmin,
                           super_size=super_size)


# ----------------------------------------------------------------------------- the format


@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_pack_gguf_dequantizes_exactly_like_gguf(qtype):
    raw = random_gguf_rows(qtype, 24, 160, seed=1)
    want = gguf_dequantize(raw.numpy(), QTYPES[qtype]).reshape(24, 160)
    got = dequantize(pack_gguf(raw, qtype))
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32)))


def test_quantized_weight_converts_without_changing_a_weight():
    """A checkpoint's 4-bit QuantizedWeight (fp32 K-quant scales; symmetric with no mins) reads
    as a W4Weight that dequantizes to exactly the checkpoint's weights."""
    kq = random_k_quant(8, 128, seed=3)
    qw = QuantizedWeight(4, kq.qweight, kq.scales, kq.mins, 32, source="gguf q4_k")
    assert (kq.scales.half().float() != kq.scales).any()  # fp16 scales would change weights
    w = from_quantized(qw)
    assert w.scales.dtype == w.mins.dtype == torch.float32
    assert torch.equal(dequantize(w), qw.dequantize())
    sym = QuantizedWeight(4, kq.qweight, kq.scales[:, ::2].half().contiguous(), None, 64)
    w = from_quantized(sym)
    assert w.mins.dtype == torch.float16 and not w.mins.any()
    assert torch.equal(dequantize(w), sym.dequantize())


def test_two_level_form_stays_two_level_on_the_device_and_dequantizes_alike():
    """A Q4_K weight's uint8 sub-block values and fp16 super-block factors reach the W4Weight as
    they are (2 bytes a 32-weight group plus 4 a super-block, not 8 a group), dequantizing to exactly the checkpoint's weights and to its fp32 one-level twin."""
    qw = random_two_level(8, 512, seed=3)
    w = from_quantized(qw)
    assert w.super_size == 256 and w.scales.dtype == w.mins.dtype == torch.uint8
    assert w.super_scales.dtype == w.super_mins.dtype == torch.float16
    assert w.nbytes() == 8 * 512 * 4.625 / 8
    flat = from_quantized(qw.one_level())
    assert flat.scales.dtype == torch.float32 and flat.nbytes() == 8 * 512 * 6 / 8
    assert torch.equal(dequantize(w), qw.dequantize())
    assert torch.equal(dequantize(w).view(torch.int32), dequantize(flat).view(torch.int32))
    with pytest.raises(ValueError, match="uint8"):
        w4a16.W4Weight(w.qweight, flat.scales, flat.mins, 32, w.super_scales, w.super_mins, 256)
    with pytest.raises(ValueError, match="multiple of group_size"):
        w4a16.W4Weight(w.qweight, w.scales, w.mins, 32, w.super_scales, w.super_mins, 48)


def test_quantize_error_within_half_a_step():
    gen = torch.Generator().manual_seed(2)
    n, k, g = 12, 352, 128  # 352 = 2 whole groups and one of 96
    w = torch.randn(n, k, generator=gen) * torch.logspace(-4, 1, n)[:, None]
    w[0, :128] = 0.375  # a constant group of an fp16 value: exact (scale 0)
    w[1, 128:256] = 1e-3 * torch.randn(128, generator=gen)
    q = quantize(w, g)
    assert q.scales.shape == (n, 3) and q.group_size == g
    err = (dequantize(q) - w).abs()
    half_step = q.scales.float().repeat_interleave(g, dim=1)[:, :k] / 2
    # w - min lies in [0, 15 scale] (min rounded down, scale up): round-to-nearest is within half
    # a step; the slack covers the fp32 arithmetic of (w - min) / scale and q * scale + min.
    assert (err <= half_step * (1 + 1e-5) + w.abs() * 2e-7).all()
    assert err[0, :128].max() == 0
    # the 4 bits are used: the step is the group's range / 15, not wider (fp16 rounding aside)
    rng = w[:, :256].reshape(n, 2, 128)
    span = (rng.amax(-1) - rng.amin(-1)) / 15
    assert (q.scales[:, :2].float() <= span * (1 + 2e-3) + 6e-8).all()


def test_format_refuses_what_the_kernels_cannot_read():
    assert w4a16.supported(torch.zeros(8, 64)) and not w4a16.supported(torch.zeros(8, 48))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 48))
    with pytest.raises(ValueError, match="group_size"):
        quantize(torch.randn(4, 64), group_size=48)
    with pytest.raises(ValueError, match="q4_0"):
        pack_gguf(torch.zeros(2, 20, dtype=torch.uint8), "q4_0")  # 20 bytes: Q4_1's block
    with pytest.raises(ValueError, match="finite"):
        quantize(torch.full((1, 32), float("nan")))
    q, s = torch.zeros(2, 32, dtype=torch.uint8), torch.ones(2, 1)
    with pytest.raises(ValueError, match="share a dtype"):
        w4a16.W4Weight(q, s, s.half(), 64)
    with pytest.raises(ValueError, match="float16/float32"):
        w4a16.W4Weight(q, s.bfloat16(), s.bfloat16(), 64)
    eight = QuantizedWeight(8, torch.zeros(2, 64, dtype=torch.int8), s, None, 64)
    with pytest.raises(ValueError, match="4-bit"):
        from_quantized(eight)
    with pytest.raises(ValueError, match="4-bit"):
        W4A16Linear(eight, device="cpu", dtype=torch.float32)


# ----------------------------------------------------------------------------- the kernels


def weights(fmt: str, n: int, k: int, seed: int, min_exp: int = -6) -> w4a16.W4Weight:
    if fmt in QTYPES:
        return pack_gguf(random_gguf_rows(fmt, n, k, seed, min_exp), fmt)
    if fmt == "q4_k":
        return random_k_quant(n, k, seed, min_exp)
    return quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05,
                    int(fmt.removeprefix("g")))


def check_dense_product(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, in_dtype_rounding: float) -> None:
    """y against the float64 product of x (as the kernel saw it) and the dense fp32 weights
    [N, K]. Bound per element, on |x| @ |W|.T (the sum the rounding errors scale with): fp32
    accumulation of K products ((K + 2) * 2^-24), plus `in_dtype_rounding` for a 16-bit result
    (its rounding) or 16-bit weight tiles (the GEMM's tensor-core inputs)."""
    assert y.dtype == x.dtype and y.shape == (x.shape[0], weight.shape[0])
    wd = weight.double().cpu()
    xd = x.double().cpu()
    ref = xd @ wd.T
    bound = (xd.abs() @ wd.abs().T) * ((weight.shape[1] + 2) * 2.0 ** -24 + in_dtype_rounding) + 1e-30
    err = (y.double().cpu() - ref).abs()
    assert (err <= bound).all(), f"worst error / bound {(err / bound).max().item():.3g}"


def check_product(y: torch.Tensor, x: torch.Tensor, w: w4a16.W4Weight, in_dtype_rounding: float) -> None:
    """check_dense_product against the dequantized 4-bit weights."""
    check_dense_product(y, x, dequantize(w), in_dtype_rounding)


SMALL = KernelConfig(block_n=16, block_k=32, split_k=3, block_m=16)
CASES = [  # (format, M, N, K): odd M, N past a block, K at the packing and group boundaries
    ("q4_0", 1, 40, 32), ("q4_0", 3, 72, 96), ("q4_0", 17, 24, 160),
    ("q4_1", 1, 33, 64), ("q4_1", 16, 40, 96), ("q4_1", 40, 17, 128),
    ("g128", 1, 40, 96), ("g128", 5, 48, 320), ("g128", 17, 33, 160), ("g32", 16, 24, 64),
    ("q4_k", 2, 40, 96), ("q4_k", 24, 33, 64),  # fp32 scales and mins
]


@pytest.mark.parametrize("fmt,m,n,k", CASES)
def test_matmul_fp32_equals_dequantize_then_matmul(device, fmt, m, n, k):
    w = weights(fmt, n, k, seed=m + n + k).to(device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(device)
    check_product(w4a16_matmul(x, w), x, w, 0.0)  # path and config picked by shape
    for path in ["gemv", "gemm"] if m <= w4a16.GEMV_MAX_M else ["gemm"]:
        # tiles smaller than the shape (one 32-input run a tile) and K split over programs
        check_product(w4a16_matmul(x, w, path=path, config=SMALL), x, w, 0.0)


# (M, N, K, super_size): K of whole super-blocks, of a partial last one, of super-blocks wider
# than a tile (SMALL's 32-input tiles: every super-block spans tiles and K chunks).
TWO_LEVEL_CASES = [(1, 40, 512, 256), (1, 33, 320, 256), (3, 24, 320, 256), (20, 17, 512, 128), (1, 24, 96, 64)]


@pytest.mark.parametrize("m,n,k,super_size", TWO_LEVEL_CASES)
def test_two_level_matmul_equals_dequantize_and_its_one_level_twin_bit_for_bit(device, m, n, k, super_size):
    qw = random_two_level(n, k, seed=m + n + k, super_size=super_size)
    w, flat = from_quantized(qw).to(device), from_quantized(qw.one_level()).to(device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(device)
    configs = [None, SMALL, dataclasses.replace(SMALL, split_k=1), KernelConfig(block_n=16, block_k=512, split_k=1)]
    for path in ["gemv", "gemm"] if m <= w4a16.GEMV_MAX_M else ["gemm"]:
        for config in configs:
            y = w4a16_matmul(x, w, path=path, config=config)
            check_product(y, x, w, 0.0)
            # the group's fp32 scale and min as the one-level form stores them: the same bits
            assert torch.equal(y.view(torch.int32), w4a16_matmul(x, flat, path=path, config=config).view(torch.int32))
    xb = x.bfloat16()  # 16-bit activations: the GEMM's weight tiles rounded to bf16 alike
    assert torch.equal(w4a16_matmul(xb, w).view(torch.int16), w4a16_matmul(xb, flat).view(torch.int16))


def test_two_level_signed_sub_block_scales(device):
    """Two-level weights may have int8 (signed) sub-block values, as QuantizedWeight allows (the
    8-bit K-quants' Q6_K and Q3_K scales): the kernels widen them with their sign, and the
    product is the one-level form's, bit for bit."""
    qw = random_two_level(24, 320, seed=11)
    gen = torch.Generator().manual_seed(12)
    signed = lambda t: torch.randint(-128, 128, tuple(t.shape), generator=gen).to(torch.int8)
    qw = dataclasses.replace(qw, scales=signed(qw.scales), mins=signed(qw.mins))
    w, flat = from_quantized(qw).to(device), from_quantized(qw.one_level()).to(device)
    assert w.scales.dtype == torch.int8 and torch.equal(dequantize(w), qw.dequantize().to(device))
    x = torch.randn(3, 320, generator=gen).to(device)
    for path, m in (("gemv", 1), ("gemm", 3)):
        y = w4a16_matmul(x[:m], w, path=path, config=SMALL)
        check_product(y, x[:m], w, 0.0)
        assert torch.equal(y.view(torch.int32), w4a16_matmul(x[:m], flat, path=path, config=SMALL).view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt,m,n,k", [("q4_1", 3, 40, 96), ("g128", 17, 33, 160), ("q4_k", 1, 24, 64)])
def test_matmul_16bit_activations(device, dtype, fmt, m, n, k):
    # scales >= 1e-3: fp16 weight tiles (the GEMM's, on a GPU) stay normal numbers, so their
    # rounding is relative as the bound assumes (dense fp16 weights would lose the same way)
    w = weights(fmt, n, k, seed=5, min_exp=-3).to(device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)).to(device=device, dtype=dtype)
    unit = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11  # the dtype's relative rounding
    # The result's rounding: the interpreter casts fp32 to bf16 by truncation (twice the error of
    # the GPU's round-to-nearest).
    result = 2 * unit if dtype == torch.bfloat16 and w4a16.INTERPRETED else unit
    for path in ["gemv", "gemm"] if m <= w4a16.GEMV_MAX_M else ["gemm"]:
        # the result's rounding; the GEMM also rounds each weight to x's dtype on the tensor cores
        check_product(w4a16_matmul(x, w, path=path, config=SMALL), x, w, 2 * unit)
    # exact: fp32 tiles and IEEE products, so only the result's rounding remains
    check_product(w4a16_matmul(x, w, path="gemm", exact=True), x, w, result)


def test_matmul_empty_and_refused(device):
    w = weights("g128", 24, 64, seed=0).to(device)
    y = w4a16_matmul(torch.empty(0, 64, device=device), w)
    assert y.shape == (0, 24)
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        w4a16_matmul(torch.randn(2, 32, device=device), w)
    with pytest.raises(ValueError, match="powers of two"):
        w4a16_matmul(torch.randn(2, 64, device=device), w, config=KernelConfig(block_n=24, block_k=64))
    with pytest.raises(ValueError, match="GEMV"):
        w4a16_matmul(torch.randn(2, 64, device=device), w, path="gemv")


def slice_k(w: w4a16.W4Weight, k0: int, k1: int) -> w4a16.W4Weight:
    """Inputs k0..k1 of w (k0 a multiple of its group size) as a W4Weight of their own."""
    g = w.group_size
    return w4a16.W4Weight(w.qweight[:, k0 // 2:k1 // 2].contiguous(), w.scales[:, k0 // g:-(-k1 // g)].contiguous(),
                          w.mins[:, k0 // g:-(-k1 // g)].contiguous(), g)


def ordered_chunk_sum(matmul, x: torch.Tensor, w, slicer, plan: w4a16.LaunchPlan, path: str) -> torch.Tensor:
    """The result of a split-K launch by `plan` as the previous two-launch form gave it: each K
    chunk's fp32 partial product (`matmul` on that chunk alone, `slicer(w, k0, k1)` its weights,
    one K chunk, the same tiles), added in chunk order in fp32, then cast to x's dtype."""
    one = KernelConfig(block_n=plan.block_n, block_k=plan.block_k, split_k=1, block_m=plan.block_m)
    k = x.shape[1]
    total = torch.zeros(x.shape[0], w.N, dtype=torch.float32, device=x.device)
    for k0 in range(0, k, plan.k_chunk):
        k1 = min(k0 + plan.k_chunk, k)
        total += matmul(x[:, k0:k1].float(), slicer(w, k0, k1), path=path, config=one)
    return total.to(x.dtype)


def split_counters(device: torch.device) -> torch.Tensor:
    """The device's counter buffer the split launches use (punica_kernels' _common.zeroed_counters)."""
    return _common.zeroed_counters(torch.device(device), 0)


# K = 224: seven 32-input tiles, so 2, 3 and 5 programs along K leave a shorter last chunk (4 + 3
# tiles, 3 + 3 + 1, 2 + 2 + 2 + 1); on the GEMM 20 rows are two M tiles, 40 outputs three N tiles.
@pytest.mark.parametrize("split", [2, 3, 5])
@pytest.mark.parametrize("path,m", [("gemv", 1), ("gemm", 1), ("gemm", 20)])
def test_split_k_sums_the_chunks_in_order_in_one_launch(device, split, path, m):
    """Each output tile's last K program adds the tile's partial sums in chunk order: the result is
    bit for bit the ordered fp32 sum of the chunks' products (the previous split-K sum kernel's),
    the same on every call, and every per-tile counter is back at 0 after each call."""
    w = weights("q4_0", 40, 224, seed=split + m).to(device)
    x = torch.randn(m, 224, generator=torch.Generator().manual_seed(split)).to(device)
    config = KernelConfig(block_n=16, block_k=32, split_k=split, block_m=16)
    plan = w4a16.launch_plan(m, 40, 224, device, path=path, config=config)
    assert plan.split_k > 1 and plan.split_k * plan.k_chunk > 224  # a shorter last chunk
    want = ordered_chunk_sum(w4a16_matmul, x, w, slice_k, plan, path)
    for _ in range(3):
        y = w4a16_matmul(x, w, path=path, config=config)
        assert torch.equal(y, want)
        assert not split_counters(device).any()
    check_product(y, x, w, 0.0)


def test_split_k_counters_grow_and_keep_the_old_buffer(device, monkeypatch):
    """A launch with more output tiles than the counter buffer holds gets a larger one; the old
    buffer (which a captured CUDA graph may still use) stays allocated, and both stay 0."""
    monkeypatch.setattr(_common, "MIN_COUNTERS", 2)
    monkeypatch.setattr(_common, "_COUNTERS", {})
    monkeypatch.setattr(_common, "_RETIRED_COUNTERS", [])
    w = weights("g32", 40, 96, seed=1).to(device)
    x = torch.randn(20, 96, generator=torch.Generator().manual_seed(1)).to(device)
    config = KernelConfig(block_n=16, block_k=32, split_k=3, block_m=16)
    check_product(w4a16_matmul(x[:1], w, path="gemv", config=config), x[:1], w, 0.0)  # 3 tiles
    first = split_counters(device)
    assert first.numel() >= 3
    y = w4a16_matmul(x, w, path="gemm", config=config)  # 2 x 3 tiles
    check_product(y, x, w, 0.0)
    assert split_counters(device).numel() >= 6 and _common._RETIRED_COUNTERS == [first]
    assert not first.any() and not split_counters(device).any()


def gated_input(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """gate | up rows [m, 2k] as a view with a row stride wider than 2k (an MLP's gu is a matmul's
    output, but the kernels take any row stride), gates spread wide enough to reach both tails of
    the activations."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(m, 2 * k + 32, generator=gen) * 3
    wide[:, :k:7] *= 10
    return wide.to(dtype)[:, :2 * k]


GATED = {"silu": norms.silu_mul, "gelu_tanh": norms.gelu_tanh_mul}


@pytest.mark.parametrize("act", sorted(GATED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path,m", [("gemv", 1), ("gemm", 1), ("gemm", 20)])
def test_gated_input_equals_the_activation_then_the_product(device, act, dtype, path, m):
    """With `act`, the matmul of gate | up rows equals the activation kernel's output multiplied
    by the same kernel, bit for bit: the activation is computed with the same numerics as it is
    loaded. Split K and one chunk, fp32 and bf16."""
    w = weights("g32", 40, 96, seed=m).to(device)
    gu = gated_input(m, 96, dtype, seed=m + 1).to(device)
    activated = GATED[act](gu)
    for split in (1, 3):
        config = KernelConfig(block_n=16, block_k=32, split_k=split, block_m=16)
        fused = w4a16_matmul(gu, w, path=path, config=config, act=act)
        assert torch.equal(fused, w4a16_matmul(activated, w, path=path, config=config))
    if dtype == torch.float32:
        check_product(fused, activated, w, 0.0)


@pytest.mark.parametrize("gpu", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
@pytest.mark.parametrize("fmt", ["q4_0", "g128", "q4_k"])
def test_tuned_gemv_config_computes_the_product(device, gpu, fmt):
    """The GEMV config tuned for H100 / H200 (128 rows x 128 inputs, four warps) on a shape it
    does not divide (N past a block, K of a partial chunk) and on one it does (whole tiles: the
    unmasked loads through stepped pointers), its K split and not, plain and gated: the product
    of the dequantized weights; gated, bit for bit the activation kernel's output multiplied by
    the same kernel."""
    config = w4a16.pick_config(gpu, "gemv", 4096, 14336)
    assert config != w4a16.CONFIGS[("default", "gemv", 0, 0)]
    for n, k in ((72, 640), (2 * config.block_n, 5 * config.block_k)):
        w = weights(fmt, n, k, seed=7).to(device)
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(8)).to(device)
        gu = gated_input(1, k, torch.float32, seed=9).to(device)
        for split in (0, 1, 3):
            tuned = dataclasses.replace(config, split_k=split)
            check_product(w4a16_matmul(x, w, path="gemv", config=tuned), x, w, 0.0)
            fused = w4a16_matmul(gu, w, path="gemv", config=tuned, act="silu")
            assert torch.equal(fused, w4a16_matmul(GATED["silu"](gu), w, path="gemv", config=tuned))


@pytest.mark.parametrize("fmt", ["q4_0", "g32", "g128", "q4_k"])
@pytest.mark.parametrize("path,m", [("gemv", 1), ("gemm", 5)])
def test_whole_tiles_take_unmasked_stepped_loads(device, fmt, path, m):
    """N a multiple of the tile's rows and K of its inputs, tiles and groups (and Q4_K's 256-input
    super-blocks) nested: the kernels load words and group parameters unmasked through
    loop-invariant pointers plus one offset a tile. The product of the dequantized weights
    whatever the K split, with groups narrower and wider than the tile, fp32 and bf16
    activations alike."""
    n, k = 48, 512
    w = weights(fmt, n, k, seed=21).to(device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(22)).to(device)
    for block_k in (32, 128):  # G 128: a group spans 4 narrow tiles, or is one wide one
        for split in (1, 3):
            config = KernelConfig(block_n=16, block_k=block_k, split_k=split, block_m=16)
            check_product(w4a16_matmul(x, w, path=path, config=config), x, w, 0.0)
            check_product(w4a16_matmul(x.bfloat16(), w, path=path, config=config), x.bfloat16(), w, 2 * 2.0 ** -8)


def test_gated_input_refused_where_it_does_not_fit(device):
    w = weights("g32", 24, 64, seed=0).to(device)
    with pytest.raises(ValueError, match="act must be"):
        w4a16_matmul(torch.randn(1, 128, device=device), w, act="relu")
    with pytest.raises(ValueError, match=r"\[M, 128\]"):
        w4a16_matmul(torch.randn(1, 64, device=device), w, act="silu")  # gate without up


def test_pick_config_falls_back_to_the_untuned_default(monkeypatch):
    tuned = KernelConfig(block_n=64, block_k=128, split_k=4)
    monkeypatch.setitem(w4a16.CONFIGS, ("NVIDIA H100 80GB HBM3", "gemm", 4096, 4096), tuned)
    assert w4a16.pick_config("NVIDIA H100 80GB HBM3", "gemm", 4096, 4096) is tuned
    assert w4a16.pick_config("NVIDIA H100 80GB HBM3", "gemm", 4096, 14336) == w4a16.CONFIGS[("default", "gemm", 0, 0)]
    assert w4a16.pick_config("some GPU", "gemm", 1, 32) == w4a16.CONFIGS[("default", "gemm", 0, 0)]


@pytest.mark.parametrize("m", [1, 3, 16, 40, 256])
@pytest.mark.parametrize("k", [4096, 14336, 96])
def test_launch_plan_splits_k_into_whole_nonempty_chunks(m, k):
    """One row takes the GEMV; wider, the tensor-core kernel with the narrowest M tile (>= 16)
    that holds the rows (up to the config's). K is split into whole, non-empty chunks of tiles
    until a decode step's N blocks fill an H100 (about 264 programs)."""
    plan = w4a16.launch_plan(m, 4096, k, torch.device("cpu"))
    if m <= w4a16.GEMV_MAX_M:
        assert plan.path == "gemv" and plan.block_m == 1
        assert plan.block_n * plan.block_k // 2 <= w4a16.GEMV_TILE_BUDGET
    else:
        assert plan.path == "gemm"
        assert plan.block_m == min(64, max(16, 1 << (m - 1).bit_length()))
    assert plan.k_chunk % plan.block_k == 0
    assert (plan.split_k - 1) * plan.k_chunk < k <= plan.split_k * plan.k_chunk
    n_programs = (4096 // plan.block_n) * -(-m // max(plan.block_m, 16))
    if k >= 4096 and m <= 16:
        assert plan.split_k > 1 and n_programs * plan.split_k >= 264


SM90_BUILD = r"""
import json, re, subprocess, tempfile
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from punica_kernels.kernels import _common

assert not _common.INTERPRETED
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
# What the launchers' calls give Triton's specialization: 16-byte aligned tensors, and K, its
# chunk, x's row stride and the rows' byte stride multiples of 16.
ALIGNED = ("x_ptr", "q_ptr", "s_ptr", "m_ptr", "ss_ptr", "sm_ptr", "out_ptr", "y_ptr", "cnt_ptr", "K", "K_CHUNK", "stride_xm", "stride_q",
           "stride_om")

def build(name, fn, codes, scales, consts, supers="*fp16", **opts):
    # One product kernel for sm_90: prints its global loads (PTX), MMA count, registers and
    # local (spill) bytes (cuobjdump, where this Triton ships it) as one JSON line. `supers`:
    # the dtype of the W4 kernels' super-block factors (ss_ptr, sm_ptr; unread with SUPER 0).
    types = {"x_ptr": "*bf16", "q_ptr": codes, "s_ptr": scales, "m_ptr": scales, "ss_ptr": supers, "sm_ptr": supers,
             "out_ptr": "*fp32", "y_ptr": "*bf16", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
             "K_CHUNK": "i32", "stride_xm": "i32", "stride_q": "i32", "stride_s": "i32", "stride_ss": "i32",
             "stride_om": "i32", "stride_ok": "i32"}
    sig = {a: "constexpr" if a in consts else types[a] for a in fn.arg_names}
    attrs = {(list(sig).index(n),): [["tt.divisibility", 16]] for n in ALIGNED if n in sig}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    usage = {}
    if CUOBJDUMP.exists():
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "k.cubin"
            cubin.write_bytes(k.asm["cubin"])
            res = subprocess.run([str(CUOBJDUMP), "-res-usage", str(cubin)], capture_output=True, text=True,
                                 check=True).stdout
        usage = {key: int(v) for key, v in re.findall(r"\b(REG|LOCAL):(\d+)", res)}
    ptx = k.asm["ptx"]
    copies = re.findall(r"cp\.async\.\w+\.shared\.global(?:\.[\w:]+)*\s+\[[^\]]+\],\s*\[[^\]]+\],\s*(\w+)", ptx)
    print(json.dumps({"name": name, "loads": sorted(set(re.findall(r"ld\.global[.\w]*", ptx))
                                                  | {f"cp.async.{int(c, 0)}" for c in copies}),
                      "mma": len(re.findall(r"\bmma\.|wgmma", ptx)), "registers": usage.get("REG"),
                      "local_bytes": usage.get("LOCAL")}))
"""

COMPILE_W4_FOR_SM90 = SM90_BUILD + r"""
from engine.backends.triton import w4a16 as W

# Split K (the decode shapes') with the plain and the gated input (the down projection's), and
# one K chunk (prefill's); one-level fp16 and fp32 scales, and Q4_K's two levels (uint8 sub-block
# values, fp16 factors per 256 inputs: SUPER 8 groups). The split variants load through stepped
# pointers (whole tiles, nested groups: w4a16.stepped), the others with masks.
for scales, sup in (("*fp16", 0), ("*fp32", 0), ("*u8", 8)):
    for split, act in ((True, "none"), (True, "silu"), (False, "none")):
        build(f"gemv {scales} split={split} {act}", W._w4_gemv_kernel, "*u8", scales,
              {"G": 32, "SUPER": sup, "BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 256, "SPLIT": split, "ACT": act,
               "STEPPED": split}, num_warps=2, num_stages=2)
    for bm, split, act in ((16, True, "none"), (16, True, "gelu_tanh"), (64, False, "none")):  # decode, prefill
        build(f"gemm m{bm} {scales} split={split} {act}", W._w4_gemm_kernel, "*u8", scales,
              {"G": 32, "SUPER": sup, "BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 128, "IEEE": False, "SPLIT": split,
               "ACT": act, "STEPPED": split}, num_warps=4, num_stages=3)
"""


def compile_for_sm90(script: str, tmp_path) -> dict[str, dict]:
    """Run a SM90_BUILD script in a process with the kernels built for the GPU (no GPU needed):
    {variant name: its figures}. Skips where a GPU is present (the device cases run the compiled
    kernels themselves) or this Triton has no NVIDIA backend."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the device cases run the compiled kernels themselves")
    pytest.importorskip("triton.backends.nvidia")
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=300, cwd=str(Path(__file__).resolve().parents[2]))
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return {r["name"]: r for r in rows}


def check_no_spills(variants: dict[str, dict]) -> None:
    """No variant uses local memory (Triton kernels use it only to spill registers), where
    cuobjdump could read the cubin."""
    for name, v in variants.items():
        assert v["local_bytes"] in (None, 0), (name, v)
        assert v["registers"] is None or 0 < v["registers"] <= 255, (name, v)


def test_kernels_compile_for_the_gpu_with_16_byte_weight_loads(tmp_path):
    """The interpreter accepts what a GPU build may refuse (tile shapes, dtypes, ops) and hides
    alignment: build the kernels for sm_90 (no GPU needed), with fp16 and fp32 scales and the
    two-level (uint8 x fp16) form, split K
    (the last program's sum) or not, the plain and the gated input, and read the weight loads (16 bytes at once, direct or as asynchronous copies to shared memory), the
    tensor-core instructions and every variant's registers."""
    variants = compile_for_sm90(COMPILE_W4_FOR_SM90, tmp_path)
    assert len(variants) == 18, variants
    for name, v in variants.items():
        assert {"ld.global.v4.b32", "ld.global.v4.u32", "cp.async.16"} & set(v["loads"]), (name, v)
        if name.startswith("gemm"):
            assert v["mma"] > 0, (name, v)  # on the tensor cores
    check_no_spills(variants)


# ----------------------------------------------------------------------------- the module


def test_linear_from_a_checkpoints_quantized_weight(device):
    raw = random_gguf_rows("q4_0", 64, 128, seed=4)
    packed = pack_gguf(raw, "q4_0")
    codes = raw.reshape(64, -1, 18)[..., 2:].reshape(64, -1).contiguous()  # the file's nibbles, block order
    qw = QuantizedWeight(4, codes, packed.scales, packed.mins, 32, source="gguf q4_0")
    lin = W4A16Linear(qw, device=device, dtype=torch.float32)
    assert {b.dtype for b in lin.buffers()} == {torch.uint8, torch.float16}  # nothing dense kept
    assert all(b.device.type == device.type for b in lin.buffers())
    assert "gguf q4_0" in repr(lin)
    weight = torch.from_numpy(np.ascontiguousarray(
        gguf_dequantize(raw.numpy(), QTYPES["q4_0"]).reshape(64, 128), dtype=np.float32))
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0)).to(device)
    check_dense_product(lin(x), x, weight, 0.0)  # the file's weights, exactly
    quantized = W4A16Linear(weight, device=device, dtype=torch.float32)
    assert quantized.group_size == w4a16.DEFAULT_GROUP_SIZE and quantized.perm is None
    check_product(w4a16_matmul(x, quantized.weight4, exact=True), x, quantized.weight4, 0.0)


@pytest.mark.parametrize("m", [2, 20])
def test_linear_fp32_scales_and_act_order_permutation(device, m):
    """fp32 scales and mins stay fp32 on the device; an act-order permutation is applied to x, so
    the layer multiplies by QuantizedWeight.dequantize() (the weights in the original input
    order), on both paths."""
    n, k = 24, 128
    kq = random_k_quant(n, k, seed=m)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(7))
    qw = QuantizedWeight(4, kq.qweight, kq.scales, kq.mins, 32, perm=perm, source="gptq g32 act-order")
    lin = W4A16Linear(qw, device=device, dtype=torch.float32)
    assert lin.scales.dtype == lin.mins.dtype == torch.float32 and lin.perm.device.type == device.type
    assert "act-order" in repr(lin)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(8)).to(device)
    check_dense_product(lin(x), x, qw.dequantize(), 0.0)
    reference = W4A16Linear(qw, device=device, dtype=torch.float32, exact=True)  # IEEE fp32 tiles
    check_dense_product(reference(x), x, qw.dequantize(), 0.0)
    # the permutation matters: the same codes in stored order give another product
    unpermuted = W4A16Linear(dataclasses.replace(qw, perm=None), device=device, dtype=torch.float32)
    assert not torch.allclose(unpermuted(x), lin(x), rtol=1e-3, atol=1e-3)
    # mins None: zeros in the scales' dtype
    sym = W4A16Linear(dataclasses.replace(qw, mins=None), device=device, dtype=torch.float32)
    assert sym.mins.dtype == torch.float32 and not sym.mins.any()
    check_dense_product(sym(x), x, dataclasses.replace(qw, mins=None).dequantize(), 0.0)


@pytest.mark.parametrize("m", [1, 20])
def test_linear_forward_gated_with_act_order_permutation(device, m):
    """forward_gated(gu, act) is forward(act_mul(gu, act)), an act-order permutation included
    (applied to the gate and the up halves alike), on both paths."""
    n, k = 24, 128
    kq = random_k_quant(n, k, seed=m)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(9))
    for p in (perm, None):
        qw = QuantizedWeight(4, kq.qweight, kq.scales, kq.mins, 32, perm=p)
        lin = W4A16Linear(qw, device=device, dtype=torch.float32)
        gu = gated_input(m, k, torch.float32, seed=m).to(device)
        for act, op in GATED.items():
            assert torch.equal(lin.forward_gated(gu, act), lin(op(gu)))
    assert "gated_perm" not in lin.state_dict()  # derived from perm, never saved
