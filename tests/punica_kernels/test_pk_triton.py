"""The Triton kernels themselves against the float64 reference, on every `device`
(tests/conftest.py's `device` fixture: CPU tensors through the interpreter, CUDA tensors where a GPU
is present). The launchers are called directly: the dispatcher would pick the torch path for
CPU tensors."""

from __future__ import annotations

import pytest
import torch
from pk_cases import (
    assert_close,
    make_batch,
    random_cases,
    reference_v,
    reference_y,
    run_expand,
    run_shrink,
    triton_devices,
)

from punica_kernels.kernels import (
    bgmv_expand_triton,
    bgmv_shrink_triton,
    sgmv_expand_triton,
    sgmv_shrink_triton,
)

SHRINK = {"bgmv": bgmv_shrink_triton, "sgmv": sgmv_shrink_triton}
EXPAND = {"bgmv": bgmv_expand_triton, "sgmv": sgmv_expand_triton}

# (T, K, S, R): one token; odd hidden sizes; many tokens over many slots; rank 128; SmolLM2 width.
SHAPES = [
    (1, 2049, 1, 1),
    (37, 129, 7, 16),
    (300, 65, 64, 8),
    (9, 2049, 5, 128),
    (24, 576, 32, 64),
]


@pytest.mark.parametrize("op", ["bgmv", "sgmv"])
@pytest.mark.parametrize("mode", ["mixed", "none", "one"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-K{}-S{}-R{}".format(*s))
def test_shrink_and_expand_match_reference(op, mode, shape, device):
    T, K, S, R = shape
    bt = make_batch(T=T, K=K, S=S, R=R, mode=mode, seed=T * 7 + K)
    v = run_shrink(SHRINK, bt.to(device), op, single=True)
    assert v.dtype == torch.float32 and v.shape == (T, R) and v.device.type == device.type
    assert_close(v, reference_v(bt, op, single=True), torch.float32)
    bt = make_batch(T=T, K=K, S=S, R=R, mode=mode, seed=T * 11 + K)  # a batch of its own for expand
    assert_close(run_expand(EXPAND, bt.to(device), op, single=True), reference_y(bt, op, single=True), torch.float32)


@pytest.mark.parametrize("op", ["bgmv", "sgmv"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes_within_tolerance(op, dtype, device):
    bt = make_batch(T=29, K=203, S=6, R=32, dtype=dtype, seed=3)
    assert_close(run_shrink(SHRINK, bt.to(device), op, single=True), reference_v(bt, op, single=True), dtype)
    y = run_expand(EXPAND, bt.to(device), op, single=True)
    assert y.dtype == dtype
    assert_close(y, reference_y(bt, op, single=True), dtype)


@pytest.mark.parametrize("op", ["bgmv", "sgmv"])
def test_qkv_slices_with_gqa_widths_in_one_launch(op, device):
    # SmolLM2-like q/k/v: 9 query heads and 3 KV heads of 64 -> widths 576, 192, 192.
    bt = make_batch(T=17, K=96, S=4, R=16, widths=(576, 192, 192), seed=5)
    v = run_shrink(SHRINK, bt.to(device), op, single=False)
    assert v.shape == (3, 17, 16)
    assert_close(v, reference_v(bt, op, single=False), torch.float32)
    assert_close(run_expand(EXPAND, bt.to(device), op, single=False), reference_y(bt, op, single=False), torch.float32)


@pytest.mark.parametrize("op", ["bgmv", "sgmv"])
def test_slices_at_custom_offsets_leave_other_columns_alone(op, device):
    # gate and up written into a wider y at columns [10, 110) and [150, 250); the rest untouched.
    bt = make_batch(T=13, K=40, S=3, R=8, widths=(100, 100), y_width=260, offsets=[10, 150], seed=6)
    y = run_expand(EXPAND, bt.to(device), op, single=False).cpu()
    assert_close(y, reference_y(bt, op, single=False), torch.float32)
    untouched = torch.cat([y[:, :10], y[:, 110:150], y[:, 250:]], 1)
    assert torch.equal(untouched, torch.cat([bt.y[:, :10], bt.y[:, 110:150], bt.y[:, 250:]], 1))


@pytest.mark.parametrize("op", ["bgmv", "sgmv"])
def test_mixed_ranks_read_only_each_slots_own_rank(op, device):
    # Ranks 1..128 in one batch; every weight past a slot's rank is NaN (make_batch), so a kernel
    # that touched the padding (the work vLLM pays by padding to max rank) would return NaN.
    ranks = [1, 2, 8, 16, 33, 64, 128]
    bt = make_batch(T=40, K=70, S=len(ranks), R=128, ranks=ranks, seed=8)
    v = run_shrink(SHRINK, bt.to(device), op, single=True)
    assert torch.isfinite(v).all()
    assert_close(v, reference_v(bt, op, single=True), torch.float32)
    y = run_expand(EXPAND, bt.to(device), op, single=True)
    assert torch.isfinite(y).all()
    assert_close(y, reference_y(bt, op, single=True), torch.float32)


def test_bgmv_shrink_split_k_sums_all_parts(device):
    bt = make_batch(T=3, K=1000, S=4, R=16, seed=9)
    d = bt.to(device)
    for split_k in (1, 3, 8):
        v = bgmv_shrink_triton(d.x, d.a[0], d.token_slots, d.scales, d.ranks, split_k=split_k, block_k=64)
        assert_close(v, reference_v(bt, "bgmv", single=True), torch.float32)


def test_empty_batch_returns_empty_and_leaves_y(device):
    bt = make_batch(T=0, K=33, S=2, R=4, seed=10).to(device)
    assert run_shrink(SHRINK, bt, "bgmv", single=True).shape == (0, 4)
    assert run_shrink(SHRINK, bt, "sgmv", single=True).shape == (0, 4)
    assert run_expand(EXPAND, bt, "bgmv", single=True).shape == (0, 33)


def test_offsets_past_int32_range(device):
    # Row (T-1) of x starts past element 2**31 at width 12288: an int32 row * stride would wrap
    # to a wrong row (the interpreter's numpy int32 arithmetic wraps like the GPU's). Only the
    # last row is touched, so the untouched pages of these large buffers cost no memory.
    K, R = 12288, 4
    T = 2**31 // K + 2
    x = torch.empty(T, K, dtype=torch.float16, device=device)
    x[-1] = torch.linspace(-1, 1, K, dtype=torch.float16)
    A = (torch.randn(1, R, K) / K**0.5).half().to(device)
    ranks, scales = torch.tensor([R], dtype=torch.int32, device=device), torch.ones(1, device=device)
    starts = torch.tensor([0, T - 1, T], dtype=torch.int32, device=device)
    seg_slots = torch.tensor([-1, 0], dtype=torch.int32, device=device)
    v = sgmv_shrink_triton(x, A, starts, seg_slots, scales, ranks, max_segment_len=1)
    want = x[-1].double() @ A[0].double().T
    torch.testing.assert_close(v[-1].double(), want, rtol=1e-2, atol=1e-2)
    del x
    B = (torch.randn(1, K, R) / R**0.5).half().to(device)
    y = torch.empty(T, K, dtype=torch.float16, device=device)
    y[-1] = 0
    sgmv_expand_triton(v, B, starts, seg_slots, ranks, y, max_segment_len=1)
    torch.testing.assert_close(y[-1].double(), B[0].double() @ v[-1].double(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("op", ["bgmv", "sgmv"])
def test_overlapping_slices_both_add_into_shared_columns(op, device):
    # Two slices writing columns [0, 40) and [24, 64): both terms land in [24, 40) (one launch
    # per slice, so no two programs read-modify-write the same elements).
    bt = make_batch(T=11, K=24, S=3, R=8, widths=(40, 40), y_width=64, offsets=[0, 24], seed=12)
    assert_close(run_expand(EXPAND, bt.to(device), op, single=False), reference_y(bt, op, single=False), torch.float32)


@random_cases(max_T=40, max_K=300, max_S=9, max_R=40, examples=30)
def test_hypothesis_shapes(case):
    # hypothesis forbids function-scoped fixtures in @given tests: the devices are looped here.
    devices = triton_devices()
    if not devices:
        pytest.skip("the kernels were compiled for the GPU and no GPU is present")
    for device in devices:
        case.check(SHRINK, EXPAND, device=device)
