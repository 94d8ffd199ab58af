"""The W8A16 kernels (engine/backends/triton/w8a16.py): the Triton matmul on a checkpoint's 8-bit
QuantizedWeight equals x @ QuantizedWeight.dequantize().T on both paths, with fp16 and fp32
scales, with and without mins, groups of 16, 32 and one per row (G = K), K not a multiple of 16,
an act-order permutation, and the K-quants' two levels (uint8 or int8 sub-block values times fp16
factors, bit for bit the fp32 one-level form); and the kernels build for sm_90 with 16-byte code
loads and no spills. Kernels run on CPU tensors through the Triton interpreter here, on CUDA tensors compiled
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


def random_two_level(n: int, k: int, group: int, super_size: int, sub_dtype: torch.dtype, mins: bool, seed: int,
                     min_exp: int = -6) -> QuantizedWeight:
    """A K-quant-like two-level weight: sub-block scales uint8 (0..255) or int8 (-128..127, both
    signs) per `group`, mins (if any) uint8, fp16 d and -dmin per `super_size` inputs of
    10^min_exp .. 1, both signs, with a +0.0 and a -0.0 d; K need not be whole super-blocks (the
    last one partial). Codes int8 over the whole range, or with mins 0..31 (Q5_K's): as in every
    K-quant with mins, code x scale is then exact in fp32, so a GPU build's fused multiply-add of
    it and the min rounds as the reference's product-then-add does."""
    gen = torch.Generator().manual_seed(seed)
    groups, supers = -(-k // group), -(-k // super_size)

    def fp16_factor() -> torch.Tensor:
        exp = torch.randint(min_exp, 1, (n, supers), generator=gen)
        sign = torch.randint(0, 2, (n, supers), generator=gen) * 2 - 1
        return (sign * (0.5 + torch.rand(n, supers, generator=gen)) * 10.0 ** exp).half()

    def sub(dtype: torch.dtype) -> torch.Tensor:
        low = -128 if dtype == torch.int8 else 0
        return torch.randint(low, low + 256, (n, groups), generator=gen).to(dtype)

    d, dmin = fp16_factor(), fp16_factor()
    d[0, 0], d[-1, -1] = 0.0, -0.0
    codes = (torch.randint(0, 32, (n, k), generator=gen) if mins else torch.randint(-128, 128, (n, k), generator=gen))
    return QuantizedWeight(8, codes.to(torch.int8), sub(sub_dtype), sub(sub_dtype) if mins else None, group,
                           source=f"test w8 two-level g{group}", super_scales=d, super_mins=-dmin if mins else None,
                           super_size=super_size)


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


# (M, N, K, group, super_size, sub-block dtype, mins): Q6_K's and Q3_K's int8 scales per 16 with no
# mins, Q5_K's and Q2_K's uint8 scales and mins; whole super-blocks, a partial last one, super-blocks
# of 48 inputs that SMALL's 32-input tiles straddle, K not a multiple of 16.
TWO_LEVEL_CASES = [
    (1, 40, 512, 16, 256, torch.int8, False), (3, 33, 320, 32, 256, torch.uint8, True),
    (20, 24, 288, 16, 256, torch.uint8, True), (1, 24, 200, 16, 48, torch.int8, False),
    (17, 40, 96, 16, 48, torch.uint8, True), (3, 17, 600, 32, 256, torch.int8, True),
]


@pytest.mark.parametrize("m,n,k,group,super_size,sub_dtype,mins", TWO_LEVEL_CASES)
def test_two_level_matmul_equals_dequantize_and_its_one_level_twin_bit_for_bit(device, m, n, k, group, super_size,
                                                                                sub_dtype, mins):
    """The K-quants' two levels: each run's sub-block value times its super-block's factor,
    multiplied in the kernel, gives the product of QuantizedWeight.dequantize() and, bit for bit,
    that of the fp32 one-level form (what these weights used to be), on both paths, with tiles
    inside one super-block (one factor a row), wider than one (512 inputs) and straddling two, K
    split into chunks that cut super-blocks."""
    qw = random_two_level(n, k, group, super_size, sub_dtype, mins, seed=m + n + k)
    w, flat = qw.to(device), qw.one_level().to(device)
    assert flat.super_size == 0 and flat.scales.dtype == torch.float32
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(device)
    configs = [None, SMALL, dataclasses.replace(SMALL, split_k=1), KernelConfig(block_n=16, block_k=512, split_k=1,
                                                                                 block_m=16)]
    for path in (["gemv", "gemm"] if m <= w8a16.GEMV_KERNEL_MAX_M else ["gemm"]):
        for config in configs:
            y = w8a16_matmul(x, w, path=path, config=config)
            check(y, x, qw, 0.0)
            assert torch.equal(y.view(torch.int32), w8a16_matmul(x, flat, path=path, config=config).view(torch.int32))
    # 16-bit activations: the GEMM's weight tiles rounded to bf16 alike
    xb = x.bfloat16()
    assert torch.equal(w8a16_matmul(xb, w).view(torch.int16), w8a16_matmul(xb, flat).view(torch.int16))


@pytest.mark.parametrize("split", [2, 3, 5])
@pytest.mark.parametrize("path,m", [("gemv", 1), ("gemm", 20)])
def test_two_level_split_k_cuts_super_blocks_and_sums_in_chunk_order(device, split, path, m):
    """K = 608 in 32-input tiles cut into 2, 3 or 5 chunks: chunk boundaries fall inside 256-input
    super-blocks (read from both sides), and the result is bit for bit the one-level form's
    ordered chunk sum, the counters back at 0."""
    qw = random_two_level(40, 608, 16, 256, torch.uint8, True, seed=split + m)
    w, flat = qw.to(device), qw.one_level().to(device)
    x = torch.randn(m, 608, generator=torch.Generator().manual_seed(split)).to(device)
    config = KernelConfig(block_n=16, block_k=32, split_k=split, block_m=16)
    plan = w8a16.plan(m, 40, 608, device, path=path, config=config)
    assert plan.split_k > 1 and any(c % 256 for c in range(plan.k_chunk, 608, plan.k_chunk))
    want = ordered_chunk_sum(w8a16_matmul, x, flat, slice_k, plan, path)
    for _ in range(2):
        assert torch.equal(w8a16_matmul(x, w, path=path, config=config), want)
        assert not split_counters(device).any()


@pytest.mark.parametrize("fp8", ["hardware", "bits"])
def test_two_level_scales_with_fp8_codes(device, fp8):
    """The code forms are independent of the scales' levels: E4M3 codes with two-level scales
    (the bit-moving decode folds its 2^8 into the run's product) equal the one-level form's."""
    if fp8 == "hardware" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("no FP8 conversion on this GPU")
    codes = random_fp8(24, 320, 16, seed=4).codes
    qw = dataclasses.replace(random_two_level(24, 320, 16, 256, torch.int8, False, seed=4), codes=codes,
                             code_format="e4m3")
    w, flat = qw.to(device), qw.one_level().to(device)
    x = torch.randn(3, 320, generator=torch.Generator().manual_seed(4)).to(device)
    for path, m in (("gemv", 1), ("gemm", 3)):
        y = w8a16_matmul(x[:m], w, path=path, config=SMALL, fp8=fp8)
        check(y, x[:m], qw, 0.0)
        assert torch.equal(y, w8a16_matmul(x[:m], flat, path=path, config=SMALL, fp8=fp8))


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q5_K", "Q6_K"])
def test_gguf_k_quants_through_the_kernels(device, qtype):
    """A GGUF file's 8-bit K-quant layer as the loader converts it (engine.loader.gguf_quants: two
    levels) multiplies to x @ gguf.quants.dequantize(...).T, bit for bit as its one-level form."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    from engine.loader.gguf_quants import quantized_weight
    from tests.engine.test_gguf_kquants import random_blocks

    t = GGMLQuantizationType[qtype]
    raw = random_blocks(t, 24, 512, seed=int(t), d_max=1.0)
    qw = quantized_weight(raw, t, (24, 512))
    assert qw.super_size == 256
    ref = torch.from_numpy(gguf_dequantize(raw, t).reshape(24, 512))
    w, flat = qw.to(device), qw.one_level().to(device)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(int(t))).to(device)
    for path, m in (("gemv", 1), ("gemm", 3)):
        y = w8a16_matmul(x[:m], w, path=path, config=SMALL)
        check_dense_product(y, x[:m], ref, 0.0)
        assert torch.equal(y.view(torch.int32), w8a16_matmul(x[:m], flat, path=path, config=SMALL).view(torch.int32))


def test_two_level_linear_keeps_the_files_bytes():
    """W8A16Linear keeps a K-quant's sub-block values and fp16 factors as they are: Q6_K's form
    reads 8.5625 bits a weight (int8 codes, an int8 scale per 16, an fp16 d per 256), not the
    one-level form's 10; Q5_K's 8.625, not 10."""
    q6 = random_two_level(8, 512, 16, 256, torch.int8, False, seed=1)
    lin = W8A16Linear(q6, device="cpu", dtype=torch.float32)
    assert {b.dtype for b in lin.buffers()} == {torch.int8, torch.float16} and lin.super_mins is None
    assert lin.weight8.nbytes() == 8 * 512 * 8.5625 / 8 and q6.one_level().nbytes() == 8 * 512 * 10 / 8
    assert "per 256" in repr(lin) and "no mins" in repr(lin)
    assert torch.equal(lin.weight8.dequantize().view(torch.int32), q6.dequantize().view(torch.int32))
    q5 = random_two_level(8, 512, 32, 256, torch.uint8, True, seed=2)
    lin = W8A16Linear(q5, device="cpu", dtype=torch.float32)
    assert {b.dtype for b in lin.buffers()} == {torch.int8, torch.uint8, torch.float16}
    assert lin.weight8.nbytes() == 8 * 512 * 8.625 / 8 and q5.one_level().nbytes() == 8 * 512 * 10 / 8
    assert torch.equal(lin.weight8.super_mins, q5.super_mins)


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

# Q8_0 (fp16, no mins), fp32 scales per 16 (no mins) and per 32 with mins (GPTQ 8-bit), per channel
# (G = K); the K-quants' two levels: Q6_K (int8 scales per 16 x fp16 d per 256: SUPER 16, no
# mins), Q5_K (uint8 scales and mins per 32 x fp16 d, -dmin: SUPER 8)
for label, scales, g, sup, has_min in (("q8_0", "*fp16", 32, 0, False), ("fp32 g16", "*fp32", 16, 0, False),
                                       ("fp32 g32 mins", "*fp32", 32, 0, True), ("channel", "*fp16", 4096, 0, False),
                                       ("q6_k", "*i8", 16, 16, False), ("q5_k", "*u8", 32, 8, True)):
    build(f"gemv {label}", W._w8_gemv_kernel, "*i8", scales,
          {"G": g, "SUPER": sup, "HAS_MIN": has_min, "BLOCK_M": 1, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT": True,
           "ACT": "none", "CODES": 0}, num_warps=4)
    build(f"gemv m16 {label}", W._w8_gemv_kernel, "*i8", scales,
          {"G": g, "SUPER": sup, "HAS_MIN": has_min, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "SPLIT": True,
           "ACT": "silu", "CODES": 0}, num_warps=4)
    build(f"gemm {label}", W._w8_gemm_kernel, "*i8", scales,
          {"G": g, "SUPER": sup, "HAS_MIN": has_min, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "IEEE": False,
           "SPLIT": False, "ACT": "none", "CODES": 0}, num_warps=4, num_stages=3)
    build(f"gemm m16 gated {label}", W._w8_gemm_kernel, "*i8", scales,
          {"G": g, "SUPER": sup, "HAS_MIN": has_min, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "IEEE": False,
           "SPLIT": True, "ACT": "gelu_tanh", "CODES": 0}, num_warps=4, num_stages=3)
# A tile wider than a super-block (each run its own factor): Q5_K's two levels at BLOCK_K 512.
build("gemm q5_k wide tile", W._w8_gemm_kernel, "*i8", "*u8",
      {"G": 32, "SUPER": 8, "HAS_MIN": True, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 512, "IEEE": False,
       "SPLIT": True, "ACT": "none", "CODES": 0}, num_warps=4, num_stages=2)
# FP8 E4M3 codes (compressed-tensors float-quantized): per channel by the hardware's conversion,
# 128 x 128 blocks (G 128) by bit moves (the path of GPUs without FP8); and E4M3 codes with
# two-level scales by bit moves (the codes and the scales' levels are independent)
for label, scales, g, sup, codes in (("fp8 channel", "*fp32", 4096, 0, W.CODES_E4M3_HW),
                                     ("fp8 block", "*fp32", 128, 0, W.CODES_E4M3_BITS),
                                     ("fp8 two-level", "*i8", 16, 16, W.CODES_E4M3_BITS)):
    build(f"gemv {label}", W._w8_gemv_kernel, "*i8", scales,
          {"G": g, "SUPER": sup, "HAS_MIN": False, "BLOCK_M": 1, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT": True,
           "ACT": "none", "CODES": codes}, num_warps=4)
    build(f"gemm {label}", W._w8_gemm_kernel, "*i8", scales,
          {"G": g, "SUPER": sup, "HAS_MIN": False, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "IEEE": False,
           "SPLIT": False, "ACT": "none", "CODES": codes}, num_warps=4, num_stages=3)
"""


def test_kernels_compile_for_the_gpu_with_16_byte_code_loads(tmp_path):
    """Every W8A16 variant the formats make (scale dtype, mins or none, group 16 to K, one or two
    levels of scales, integer or FP8 E4M3 codes; the GEMV at one row and at 16, the GEMM; K split
    or not, the plain or the gated input) builds for sm_90 with no spills; the one-row GEMV loads
    each run's 16 codes as one vector, and the GEMM runs on the tensor cores."""
    variants = compile_for_sm90(COMPILE_W8_FOR_SM90, tmp_path)
    assert len(variants) == 31, variants
    for label in ("q8_0", "fp32 g16", "fp32 g32 mins", "channel", "q6_k", "q5_k", "fp8 channel", "fp8 block",
                  "fp8 two-level"):
        assert "ld.global.v4.b32" in variants[f"gemv {label}"]["loads"], variants
        assert variants[f"gemm {label}"]["mma"] > 0, variants
    for label in ("q8_0", "fp32 g16", "fp32 g32 mins", "channel", "q6_k", "q5_k"):
        assert variants[f"gemm m16 gated {label}"]["mma"] > 0, variants
    assert variants["gemm q5_k wide tile"]["mma"] > 0, variants
    check_no_spills(variants)
