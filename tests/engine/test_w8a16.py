"""The W8A16 kernels (engine/backends/triton/w8a16.py): the Triton matmul on a checkpoint's 8-bit
QuantizedWeight equals x @ QuantizedWeight.dequantize().T on both paths, with fp16 and fp32
scales, with and without mins, groups of 16, 32 and one per row (G = K), K not a multiple of 16,
and an act-order permutation; and the kernels build for sm_90 with 16-byte code loads and no
spills. Kernels run on CPU tensors through the Triton interpreter here, on CUDA tensors compiled
where a GPU is present (see tests/conftest.py's `device` fixture)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.backends.triton import w4a16, w8a16
from engine.backends.triton.w4a16 import KernelConfig
from engine.backends.triton.w8a16 import W8A16Linear, w8a16_matmul
from engine.loader.quantized import QuantizedWeight
from tests.engine.test_w4a16 import (GATED, SM90_BUILD, check_dense_product, check_no_spills, compile_for_sm90,
                                     gated_input, ordered_chunk_sum, split_counters)


def random_w8(n: int, k: int, group: int, scale_dtype: torch.dtype, mins: bool, seed: int, min_exp: int = -6,
              perm: bool = False) -> QuantizedWeight:
    """Random int8 codes over the whole range, signed scales of magnitude 10^min_exp .. 1 in
    `scale_dtype` (and mins of a tenth of that), optionally a random input permutation."""
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    codes = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    exp = torch.randint(min_exp, 1, (n, groups), generator=gen)
    sign = torch.randint(0, 2, (n, groups), generator=gen) * 2 - 1
    scales = (sign * (0.5 + torch.rand(n, groups, generator=gen)) * 10.0 ** exp).to(scale_dtype)
    m = (torch.randn(n, groups, generator=gen) * 10.0 ** exp * 0.1).to(scale_dtype) if mins else None
    order = torch.randperm(k, generator=gen) if perm else None
    return QuantizedWeight(8, codes, scales, m, group, perm=order, source=f"test w8 g{group}")


def check(y: torch.Tensor, x: torch.Tensor, w: QuantizedWeight, in_dtype_rounding: float) -> None:
    check_dense_product(y, x, w.dequantize(), in_dtype_rounding)


SMALL = KernelConfig(block_n=16, block_k=32, split_k=3, block_m=16)
CASES = [  # (M, N, K, group, scale dtype, mins): odd M and N, both paths, K past group and tile edges
    (1, 40, 64, 16, torch.float32, True), (3, 33, 96, 32, torch.float16, False),
    (3, 24, 40, 16, torch.float16, True),  # K % 16 != 0: a partial run
    (16, 17, 64, 64, torch.float32, False), (24, 40, 96, 96, torch.float16, False),  # per channel: G = K
    (24, 33, 128, 32, torch.float32, True), (20, 24, 80, 16, torch.float16, True),
]


@pytest.mark.parametrize("m,n,k,group,scale_dtype,mins", CASES)
def test_matmul_fp32_equals_dequantize_then_matmul(device, m, n, k, group, scale_dtype, mins):
    w = random_w8(n, k, group, scale_dtype, mins, seed=m + n + k).to(device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(device)
    check(w8a16_matmul(x, w), x, w, 0.0)  # path and config picked by shape
    for path in (["gemv", "gemm"] if m <= w8a16.GEMV_KERNEL_MAX_M else ["gemm"]):
        # forced, with tiles smaller than the shape and K split over programs
        check(w8a16_matmul(x, w, path=path, config=SMALL), x, w, 0.0)


def random_fp8(n: int, k: int, group: int, seed: int) -> QuantizedWeight:
    """FP8 E4M3 codes drawn over every finite bit pattern (subnormals, both zeros and +-448
    included), fp32 scales per row and group."""
    gen = torch.Generator().manual_seed(seed)
    patterns = torch.arange(256, dtype=torch.int32)
    finite = patterns[(patterns & 0x7F) != 0x7F]
    codes = finite[torch.randint(0, finite.numel(), (n, k), generator=gen)].to(torch.uint8).view(torch.int8)
    scales = (0.5 + torch.rand(n, -(-k // group), generator=gen)) / 448
    return QuantizedWeight(8, codes, scales, None, group, source="test fp8", code_format="e4m3")


@pytest.mark.parametrize("fp8", ["hardware", "bits"])
@pytest.mark.parametrize("m,n,k,group", [(1, 40, 256, 256), (3, 33, 96, 32), (20, 24, 256, 128)])
def test_fp8_codes_equal_dequantize_then_matmul(device, m, n, k, group, fp8):
    """FP8 E4M3 codes are decoded in the kernels to exactly the numbers they encode (torch's
    float8_e4m3fn), by the hardware's conversion or by bit moves: the product equals
    x @ dequantize().T on both paths, split or not, and every weight comes out exact."""
    if fp8 == "hardware" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("no FP8 conversion on this GPU")
    w = random_fp8(n, k, group, seed=m + n).to(device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(device)
    check(w8a16_matmul(x, w, fp8=fp8), x, w, 0.0)
    for path in (["gemv", "gemm"] if m <= w8a16.GEMV_KERNEL_MAX_M else ["gemm"]):
        check(w8a16_matmul(x, w, path=path, config=SMALL, fp8=fp8), x, w, 0.0)
    # every code alone: one row of the identity picks each weight out exactly
    eye = torch.eye(k, device=device)[:16]
    got = w8a16_matmul(eye, w, path="gemm", exact=True, fp8=fp8)
    assert torch.equal(got, w.dequantize()[:, :16].t().contiguous())
    lin = W8A16Linear(w, device=device, dtype=torch.float32)
    assert lin.weight8.code_format == "e4m3" and "e4m3" in repr(lin)
    check(lin(x), x, w, 0.0)


def slice_k(w: QuantizedWeight, k0: int, k1: int) -> QuantizedWeight:
    """Inputs k0..k1 of w (k0 a multiple of its group size; no permutation) as a weight of their own."""
    g = w.group_size
    part = lambda t: None if t is None else t[:, k0 // g:-(-k1 // g)].contiguous()
    return QuantizedWeight(8, w.codes[:, k0:k1].contiguous(), part(w.scales), part(w.mins), g)


# K = 208: thirteen 16-input runs in seven 32-input tiles (the last half full), so 2, 3 and 5
# programs along K leave a shorter last chunk; 20 rows are two GEMM M tiles, 40 outputs three N tiles.
@pytest.mark.parametrize("split", [2, 3, 5])
@pytest.mark.parametrize("path,m", [("gemv", 1), ("gemv", 3), ("gemm", 20)])
def test_split_k_sums_the_chunks_in_order_in_one_launch(device, split, path, m):
    """As the 4-bit kernels (w4a16.split_k_store): bit for bit the chunks' products added in chunk
    order, the same on every call, the per-tile counters back at 0."""
    w = random_w8(40, 208, 16, torch.float32, True, seed=split + m).to(device)
    x = torch.randn(m, 208, generator=torch.Generator().manual_seed(split)).to(device)
    config = KernelConfig(block_n=16, block_k=32, split_k=split, block_m=16)
    plan = w8a16.plan(m, 40, 208, device, path=path, config=config)
    assert plan.split_k > 1 and plan.split_k * plan.k_chunk > 208
    want = ordered_chunk_sum(w8a16_matmul, x, w, slice_k, plan, path)
    for _ in range(3):
        y = w8a16_matmul(x, w, path=path, config=config)
        assert torch.equal(y, want)
        assert not split_counters(device).any()
    check(y, x, w, 0.0)


@pytest.mark.parametrize("act", sorted(GATED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path,m", [("gemv", 1), ("gemv", 3), ("gemm", 20)])
def test_gated_input_equals_the_activation_then_the_product(device, act, dtype, path, m):
    """With `act`, the matmul of gate | up rows equals the activation kernel's output multiplied
    by the same kernel, bit for bit; an act-order permutation applies to both halves."""
    w = random_w8(40, 96, 32, torch.float16, True, seed=m, perm=True).to(device)
    gu = gated_input(m, 96, dtype, seed=m + 1).to(device)
    activated = GATED[act](gu)
    for split in (1, 3):
        config = KernelConfig(block_n=16, block_k=32, split_k=split, block_m=16)
        fused = w8a16_matmul(gu, w, path=path, config=config, act=act)
        assert torch.equal(fused, w8a16_matmul(activated, w, path=path, config=config))
    lin = W8A16Linear(w.to("cpu"), device=device, dtype=dtype)
    assert torch.equal(lin.forward_gated(gu, act), lin(activated))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,group,scale_dtype,mins", [(3, 40, 96, 32, torch.float32, True),
                                                          (24, 33, 64, 16, torch.float16, False)])
def test_matmul_16bit_activations(device, dtype, m, n, k, group, scale_dtype, mins):
    # scales >= 1e-3: the GEMM's 16-bit weight tiles (on a GPU) stay normal numbers, so their
    # rounding is relative as the bound assumes
    w = random_w8(n, k, group, scale_dtype, mins, seed=5, min_exp=-3).to(device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)).to(device=device, dtype=dtype)
    unit = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11  # the dtype's relative rounding
    # The result's rounding: the interpreter casts fp32 to bf16 by truncation (twice the error of
    # the GPU's round-to-nearest).
    result = 2 * unit if dtype == torch.bfloat16 and w4a16.INTERPRETED else unit
    for path in (["gemv", "gemm"] if m <= w8a16.GEMV_KERNEL_MAX_M else ["gemm"]):
        # the result's rounding; the GEMM on a GPU also rounds each weight to x's dtype for the
        # tensor cores (under the interpreter a bf16 GEMM runs on fp32 tiles instead)
        check(w8a16_matmul(x, w, path=path, config=SMALL), x, w, 2 * unit)
    # exact: fp32 tiles and IEEE products, so only the result's rounding remains
    check(w8a16_matmul(x, w, path="gemm", exact=True), x, w, result)


@pytest.mark.parametrize("m", [1, 24])
def test_linear_keeps_the_checkpoint_and_applies_its_permutation(device, m):
    n, k = 24, 64
    qw = random_w8(n, k, 32, torch.float32, True, seed=9, perm=True)
    lin = W8A16Linear(qw, device=device, dtype=torch.float32)
    assert {b.dtype for b in lin.buffers()} == {torch.int8, torch.float32, torch.int64}  # codes, scales + mins, perm
    assert all(b.device.type == device.type for b in lin.buffers())
    assert "test w8 g32" in repr(lin) and "act-order" in repr(lin)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(10)).to(device)
    check(lin(x), x, qw, 0.0)  # y = x @ dequantize().T: the weights in the original input order
    check(W8A16Linear(qw, device=device, dtype=torch.float32, exact=True)(x), x, qw, 0.0)  # IEEE fp32 tiles
    unpermuted = W8A16Linear(dataclasses.replace(qw, perm=None), device=device, dtype=torch.float32)
    assert not torch.allclose(unpermuted(x), lin(x), rtol=1e-3, atol=1e-3)
    # symmetric: no mins on the device at all
    sym = dataclasses.replace(qw, mins=None, perm=None, scales=qw.scales.half())
    lin = W8A16Linear(sym, device=device, dtype=torch.float32)
    assert lin.mins is None and {b.dtype for b in lin.buffers()} == {torch.int8, torch.float16}
    check(lin(x), x, sym, 0.0)


def test_refused_inputs_are_clear_errors(device):
    w = random_w8(24, 64, 32, torch.float16, False, seed=0).to(device)
    assert w8a16_matmul(torch.empty(0, 64, device=device), w).shape == (0, 24)
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        w8a16_matmul(torch.randn(2, 32, device=device), w)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        w8a16_matmul(torch.ones(2, 64, dtype=torch.int32, device=device), w)
    with pytest.raises(ValueError, match="powers of two >= 16"):
        w8a16_matmul(torch.randn(2, 64, device=device), w, config=KernelConfig(block_n=16, block_k=8))
    with pytest.raises(ValueError, match="GEMV"):
        w8a16_matmul(torch.randn(17, 64, device=device), w, path="gemv")
    four = QuantizedWeight(4, torch.zeros(24, 32, dtype=torch.uint8), w.scales, None, 32)
    with pytest.raises(ValueError, match="8-bit"):
        w8a16_matmul(torch.randn(2, 64, device=device), four)
    with pytest.raises(ValueError, match="8-bit"):
        W8A16Linear(four, device=device, dtype=torch.float32)
    with pytest.raises(ValueError, match="8-bit"):
        W8A16Linear(torch.zeros(24, 64), device=device, dtype=torch.float32)
    with pytest.raises(ValueError, match="contiguous"):
        w8a16_matmul(torch.randn(2, 64, device=device), dataclasses.replace(w, scales=w.scales.t().contiguous().t()))


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("k", [4096, 14336, 80])
def test_launch_plan_fits_the_register_budget_in_whole_chunks(m, k):
    """One row takes the GEMV by default, more the tensor-core GEMM; the GEMV asked for by name
    takes up to 16 rows within the register budget, K in whole non-empty chunks."""
    assert w8a16.plan(m, 4096, k, torch.device("cpu")).path == ("gemv" if m <= w8a16.GEMV_MAX_M else "gemm")
    plan = w8a16.plan(m, 4096, k, torch.device("cpu"), path="gemv")
    assert plan.path == "gemv" and plan.block_m >= m and plan.block_k >= w8a16.RUN
    assert plan.block_m * plan.block_n * plan.block_k <= w4a16.GEMV_TILE_BUDGET  # one input a product
    assert plan.k_chunk % plan.block_k == 0
    assert (plan.split_k - 1) * plan.k_chunk < k <= plan.split_k * plan.k_chunk
    assert w8a16.plan(40, 4096, k, torch.device("cpu")).path == "gemm"


COMPILE_W8_FOR_SM90 = SM90_BUILD + r"""
from engine.backends.triton import w8a16 as W

# Q8_0 (fp16, no mins), Q6_K (fp32, G 16, no mins), Q5_K (fp32 with mins), per channel (G = K)
for label, scales, g, has_min in (("q8_0", "*fp16", 32, False), ("q6_k", "*fp32", 16, False),
                                  ("q5_k", "*fp32", 32, True), ("channel", "*fp16", 4096, False)):
    build(f"gemv {label}", W._w8_gemv_kernel, "*i8", scales,
          {"G": g, "HAS_MIN": has_min, "BLOCK_M": 1, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT": True, "ACT": "none",
           "CODES": 0}, num_warps=4)
    build(f"gemv m16 {label}", W._w8_gemv_kernel, "*i8", scales,
          {"G": g, "HAS_MIN": has_min, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "SPLIT": True, "ACT": "silu",
           "CODES": 0}, num_warps=4)
    build(f"gemm {label}", W._w8_gemm_kernel, "*i8", scales,
          {"G": g, "HAS_MIN": has_min, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "IEEE": False, "SPLIT": False,
           "ACT": "none", "CODES": 0}, num_warps=4, num_stages=3)
    build(f"gemm m16 gated {label}", W._w8_gemm_kernel, "*i8", scales,
          {"G": g, "HAS_MIN": has_min, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "IEEE": False, "SPLIT": True,
           "ACT": "gelu_tanh", "CODES": 0}, num_warps=4, num_stages=3)
# FP8 E4M3 codes (compressed-tensors float-quantized): per channel by the hardware's conversion,
# 128 x 128 blocks (G 128) by bit moves (the path of GPUs without FP8)
for label, g, codes in (("fp8 channel", 4096, W.CODES_E4M3_HW), ("fp8 block", 128, W.CODES_E4M3_BITS)):
    build(f"gemv {label}", W._w8_gemv_kernel, "*i8", "*fp32",
          {"G": g, "HAS_MIN": False, "BLOCK_M": 1, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT": True, "ACT": "none",
           "CODES": codes}, num_warps=4)
    build(f"gemm {label}", W._w8_gemm_kernel, "*i8", "*fp32",
          {"G": g, "HAS_MIN": False, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "IEEE": False, "SPLIT": False,
           "ACT": "none", "CODES": codes}, num_warps=4, num_stages=3)
"""


def test_kernels_compile_for_the_gpu_with_16_byte_code_loads(tmp_path):
    """Every W8A16 variant the formats make (scale dtype, mins or none, group 16 to K, integer or
    FP8 E4M3 codes; the GEMV at one row and at 16, the GEMM; K split or not, the plain or the
    gated input) builds for sm_90
    with no spills; the one-row GEMV loads each
    run's 16 codes as one vector, and the GEMM runs on the tensor cores."""
    variants = compile_for_sm90(COMPILE_W8_FOR_SM90, tmp_path)
    assert len(variants) == 20, variants
    for label in ("q8_0", "q6_k", "q5_k", "channel", "fp8 channel", "fp8 block"):
        assert "ld.global.v4.b32" in variants[f"gemv {label}"]["loads"], variants
        assert variants[f"gemm {label}"]["mma"] > 0, variants
    for label in ("q8_0", "q6_k", "q5_k", "channel"):
        assert variants[f"gemm m16 gated {label}"]["mma"] > 0, variants
    check_no_spills(variants)
