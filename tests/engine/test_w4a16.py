"""The W4A16 format and kernels (engine/backends/triton/w4a16.py): GGUF blocks and load-time
quantization dequantize to what they should, and the Triton matmul on 4-bit weights equals
dequantize-then-matmul. Kernels run on CPU tensors through the Triton interpreter here, on CUDA
tensors compiled where a GPU is present (`TRITON_INTERPRET=0 pytest ...`; see
tests/conftest.py's `device` fixture)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from engine.backends.cpu import q4 as cpu_q4
from engine.backends.triton import w4a16
from engine.backends.triton.w4a16 import KernelConfig, W4A16Linear, dequantize, pack_gguf, quantize, w4a16_matmul
from engine.loader import load_checkpoint
from engine.loader.gguf_loader import Q4_0_SUFFIX, Q4_1_SUFFIX
from engine.loader.synthetic import write_synthetic_gguf

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


# ----------------------------------------------------------------------------- the format


@pytest.mark.parametrize("qtype", sorted(QTYPES))
def test_pack_gguf_dequantizes_exactly_like_gguf(qtype):
    raw = random_gguf_rows(qtype, 24, 160, seed=1)
    want = gguf_dequantize(raw.numpy(), QTYPES[qtype]).reshape(24, 160)
    got = dequantize(pack_gguf(raw, qtype))
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32)))


@pytest.mark.parametrize("quant", ["q4_0", "q4_1"])
def test_loader_keeps_raw_rows_that_dequantize_to_the_weights(tmp_path, quant):
    _, tensors, _ = load_checkpoint(write_synthetic_gguf(tmp_path / f"{quant}.gguf", "tiny", quant=quant))
    suffix, other = (Q4_0_SUFFIX, Q4_1_SUFFIX) if quant == "q4_0" else (Q4_1_SUFFIX, Q4_0_SUFFIX)
    raws = {k[: -len(suffix)]: v for k, v in tensors.items() if k.endswith(suffix)}
    assert not any(k.endswith(other) for k in tensors)
    # every layer linear (7 a layer, 2 layers), Q/K rows un-permuted like their weights
    assert len(raws) == 14 and "model.layers.1.self_attn.q_proj.weight" in raws
    for name, raw in raws.items():
        assert torch.equal(dequantize(pack_gguf(raw, quant)), tensors[name]), name
        if quant == "q4_1":  # the CPU backend's reading of the same rows
            assert torch.equal(cpu_q4.dequantize(raw), tensors[name]), name


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


# ----------------------------------------------------------------------------- the kernels


def weights(fmt: str, n: int, k: int, seed: int, min_exp: int = -6) -> w4a16.W4Weight:
    if fmt in QTYPES:
        return pack_gguf(random_gguf_rows(fmt, n, k, seed, min_exp), fmt)
    return quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05,
                    int(fmt.removeprefix("g")))


def check_product(y: torch.Tensor, x: torch.Tensor, w: w4a16.W4Weight, in_dtype_rounding: float) -> None:
    """y against the float64 product of x (as the kernel saw it) and the dequantized weights.
    Bound per element, on |x| @ |W|.T (the sum the rounding errors scale with): fp32 accumulation
    of K products ((K + 2) * 2^-24), plus `in_dtype_rounding` for a 16-bit result (its rounding)
    or 16-bit weight tiles (the GEMM's tensor-core inputs)."""
    assert y.dtype == x.dtype and y.shape == (x.shape[0], w.N)
    wd = dequantize(w).double().cpu()
    xd = x.double().cpu()
    ref = xd @ wd.T
    bound = (xd.abs() @ wd.abs().T) * ((w.K + 2) * 2.0 ** -24 + in_dtype_rounding) + 1e-30
    err = (y.double().cpu() - ref).abs()
    assert (err <= bound).all(), f"worst error / bound {(err / bound).max().item():.3g}"


SMALL = KernelConfig(block_n=16, block_k=32, split_k=3, block_m=16)
CASES = [  # (format, M, N, K): odd M, N past a block, K at the packing and group boundaries
    ("q4_0", 1, 40, 32), ("q4_0", 3, 72, 96), ("q4_0", 17, 24, 160),
    ("q4_1", 1, 33, 64), ("q4_1", 16, 40, 96), ("q4_1", 40, 17, 128),
    ("g128", 1, 40, 96), ("g128", 5, 48, 320), ("g128", 17, 33, 160), ("g32", 16, 24, 64),
]


@pytest.mark.parametrize("fmt,m,n,k", CASES)
def test_matmul_fp32_equals_dequantize_then_matmul(device, fmt, m, n, k):
    w = weights(fmt, n, k, seed=m + n + k).to(device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(device)
    paths = ["gemv", "gemm"] if m <= w4a16.GEMV_MAX_M else ["gemm"]
    check_product(w4a16_matmul(x, w), x, w, 0.0)  # path and config picked by shape
    for path in paths:  # forced, with tiles smaller than the shape and K split over programs
        check_product(w4a16_matmul(x, w, path=path, config=SMALL), x, w, 0.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt,m,n,k", [("q4_1", 3, 40, 96), ("g128", 17, 33, 160)])
def test_matmul_16bit_activations(device, dtype, fmt, m, n, k):
    # scales >= 1e-3: fp16 weight tiles (the GEMM's, on a GPU) stay normal numbers, so their
    # rounding is relative as the bound assumes (dense fp16 weights would lose the same way)
    w = weights(fmt, n, k, seed=5, min_exp=-3).to(device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)).to(device=device, dtype=dtype)
    unit = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11  # the dtype's relative rounding
    for path in (["gemv", "gemm"] if m <= w4a16.GEMV_MAX_M else ["gemm"]):
        # the result's rounding; the GEMM also rounds each weight to x's dtype on the tensor cores
        check_product(w4a16_matmul(x, w, path=path, config=SMALL), x, w, 2 * unit)
    # exact: fp32 tiles and IEEE products, so only the result's rounding remains
    check_product(w4a16_matmul(x, w, path="gemm", exact=True), x, w, unit)


def test_matmul_empty_and_refused(device):
    w = weights("g128", 24, 64, seed=0).to(device)
    y = w4a16_matmul(torch.empty(0, 64, device=device), w)
    assert y.shape == (0, 24)
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        w4a16_matmul(torch.randn(2, 32, device=device), w)
    with pytest.raises(ValueError, match="powers of two"):
        w4a16_matmul(torch.randn(2, 64, device=device), w, config=KernelConfig(block_n=24, block_k=64))
    with pytest.raises(ValueError, match="GEMV"):
        w4a16_matmul(torch.randn(17, 64, device=device), w, path="gemv")


def test_pick_config_falls_back_to_the_untuned_default(monkeypatch):
    tuned = KernelConfig(block_n=64, block_k=128, split_k=4)
    monkeypatch.setitem(w4a16.CONFIGS, ("NVIDIA H100 80GB HBM3", "gemv", 4096, 4096), tuned)
    assert w4a16.pick_config("NVIDIA H100 80GB HBM3", "gemv", 4096, 4096) is tuned
    assert w4a16.pick_config("NVIDIA H100 80GB HBM3", "gemv", 4096, 14336) == w4a16.CONFIGS[("default", "gemv", 0, 0)]
    assert w4a16.pick_config("some GPU", "gemm", 1, 32) == w4a16.CONFIGS[("default", "gemm", 0, 0)]


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("k", [4096, 14336, 96])
def test_launch_plan_splits_k_into_whole_nonempty_chunks(m, k):
    plan = w4a16.launch_plan(m, 4096, k, torch.device("cpu"))
    assert plan.path == "gemv" and plan.block_m >= m
    assert plan.block_m * plan.block_n * plan.block_k // 2 <= w4a16.GEMV_TILE_BUDGET
    assert plan.k_chunk % plan.block_k == 0
    assert (plan.split_k - 1) * plan.k_chunk < k <= plan.split_k * plan.k_chunk
    wide = w4a16.launch_plan(40, 4096, k, torch.device("cpu"))
    assert wide.path == "gemm" and min(wide.block_m, wide.block_n) >= 16


COMPILE_FOR_SM90 = r"""
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.backends.triton import w4a16 as W

assert not W.INTERPRETED
ARGS = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp16", "m_ptr": "*fp16", "out_ptr": "*fp32", "M": "i32",
        "N": "i32", "K": "i32", "K_CHUNK": "i32", "stride_xm": "i32", "stride_q": "i32", "stride_s": "i32",
        "stride_om": "i32", "stride_ok": "i32"}
# What the launcher's calls give Triton's specialization: 16-byte aligned tensors, and K, its
# chunk, x's row stride and the rows' byte stride multiples of 16 (K % 32 == 0).
ALIGNED = [n for n in ARGS if n.endswith("_ptr")] + ["K", "K_CHUNK", "stride_xm", "stride_q", "stride_om"]

def build(fn, consts, **opts):
    sig = dict(ARGS, **{c: "constexpr" for c in consts})
    attrs = {(list(sig).index(n),): [["tt.divisibility", 16]] for n in ALIGNED}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

gemv = build(W._w4_gemv_kernel, {"G": 128, "BLOCK_M": 1, "BLOCK_N": 32, "BLOCK_K": 256}, num_warps=4)
gemm = build(W._w4_gemm_kernel, {"G": 32, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "IEEE": False}, num_warps=4)
src = ASTSource(fn=W._split_k_sum_kernel, signature={"ws_ptr": "*fp32", "y_ptr": "*bf16", "MN": "i32",
                "SPLIT_K": "i32", "BLOCK": "constexpr"}, constexprs={"BLOCK": 1024})
triton.compile(src, target=GPUTarget("cuda", 90, 32))
print("gemv loads", sorted(set(re.findall(r"ld\.global[.\w]*", gemv))))
print("gemm mma", len(re.findall(r"\bmma\.|wgmma", gemm)))
"""


def test_kernels_compile_for_the_gpu_with_16_byte_weight_loads(tmp_path):
    """The interpreter accepts what a GPU build may refuse (tile shapes, dtypes, ops) and hides
    alignment: build the kernels for sm_90 (no GPU needed) and read the GEMV's weight loads."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the device cases run the compiled kernels themselves")
    pytest.importorskip("triton.backends.nvidia")
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                         timeout=300, cwd=str(Path(__file__).resolve().parents[2]))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ld.global.v4.b32" in run.stdout, run.stdout  # each block's 16 bytes in one load
    assert "gemm mma 0" not in run.stdout, run.stdout  # the GEMM is on the tensor cores


# ----------------------------------------------------------------------------- the module


def test_linear_from_gguf_rows_and_quantized(tmp_path, device):
    _, tensors, _ = load_checkpoint(write_synthetic_gguf(tmp_path / "q4_0.gguf", "tiny", quant="q4_0"))
    name = "model.layers.0.self_attn.k_proj.weight"  # 64 x 128, rows un-permuted
    weight, raw = tensors[name], tensors[name + Q4_0_SUFFIX]
    lin = W4A16Linear(weight, raw=raw, qtype="q4_0", device=device, dtype=torch.float32)
    assert {b.dtype for b in lin.buffers()} == {torch.uint8, torch.float16}  # nothing dense kept
    assert all(b.device.type == device.type for b in lin.buffers())
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0)).to(device)
    ref = (x.double().cpu() @ weight.double().T)  # the file's weights, exactly
    bound = (x.double().cpu().abs() @ weight.double().abs().T) * 130 * 2.0 ** -24
    assert ((lin(x).double().cpu() - ref).abs() <= bound).all()
    with pytest.raises(ValueError, match="do not dequantize"):
        W4A16Linear(weight, raw=raw.flip(0), qtype="q4_0", device=device, dtype=torch.float32)
    quantized = W4A16Linear(weight, device=device, dtype=torch.float32)
    assert quantized.group_size == w4a16.DEFAULT_GROUP_SIZE
    check_product(quantized(x, exact=True), x, quantized.weight4, 0.0)
