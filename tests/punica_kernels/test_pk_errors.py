"""Bad calls raise one clear TypeError/ValueError, on the dispatcher (CPU path) and on the
Triton launchers alike, before anything is computed."""

from __future__ import annotations

import pytest
import torch

import punica_kernels as pk
from punica_kernels.kernels import bgmv_expand_triton, bgmv_shrink_triton, sgmv_expand_triton, sgmv_shrink_triton

T, K, S, R, N = 6, 32, 4, 8, 24


def good():
    return dict(
        x=torch.randn(T, K), a=torch.randn(S, R, K), b=torch.randn(S, N, R),
        slots=torch.tensor([0, 1, -1, 3, 3, 2], dtype=torch.int32),
        starts=torch.tensor([0, 2, 6], dtype=torch.int32), seg_slots=torch.tensor([1, -1], dtype=torch.int32),
        scales=torch.ones(S), ranks=torch.tensor([8, 4, 2, 1], dtype=torch.int32),
        v=torch.zeros(T, R), y=torch.zeros(T, N),
    )


SHRINKS = {"bgmv": (pk.bgmv_shrink, bgmv_shrink_triton), "sgmv": (pk.sgmv_shrink, sgmv_shrink_triton)}
EXPANDS = {"bgmv": (pk.bgmv_expand, bgmv_expand_triton), "sgmv": (pk.sgmv_expand, sgmv_expand_triton)}


def call_shrink(fn, op, g):
    if op == "bgmv":
        return fn(g["x"], g["a"], g["slots"], g["scales"], g["ranks"])
    return fn(g["x"], g["a"], g["starts"], g["seg_slots"], g["scales"], g["ranks"])


def call_expand(fn, op, g, **kw):
    if op == "bgmv":
        return fn(g["v"], g["b"], g["slots"], g["ranks"], g["y"], **kw)
    return fn(g["v"], g["b"], g["starts"], g["seg_slots"], g["ranks"], g["y"], **kw)


SHRINK_BAD = [
    ("x fp64", lambda g: g.update(x=g["x"].double()), TypeError, "x has dtype float64"),
    ("dtype mismatch", lambda g: g.update(a=g["a"].half()), TypeError, "must match"),
    ("x 3-D", lambda g: g.update(x=g["x"][None]), ValueError, "x must be 2-D"),
    ("width", lambda g: g.update(a=torch.randn(S, R, K + 1)), ValueError, "last dim must equal"),
    ("non-contiguous x", lambda g: g.update(x=torch.randn(K, T).t()), ValueError, "contiguous"),
    ("non-contiguous a", lambda g: g.update(a=torch.randn(S, K, R).transpose(1, 2)), ValueError, "contiguous"),
    ("rank > R", lambda g: g.update(ranks=torch.tensor([9, 1, 1, 1])), ValueError, r"ranks must lie in \[0, 8\]"),
    ("ranks float", lambda g: g.update(ranks=g["ranks"].float()), TypeError, "ranks has dtype"),
    ("ranks count", lambda g: g.update(ranks=g["ranks"][:3]), ValueError, "ranks has 3 entries"),
    ("scales fp16", lambda g: g.update(scales=g["scales"].half()), TypeError, "scales has dtype"),
    ("slot too big", lambda g: g.update(slots=torch.tensor([0, 1, 4, 0, 0, 0], dtype=torch.int32),
                                        seg_slots=torch.tensor([4, 0], dtype=torch.int32)), ValueError, "outside"),
    ("slot -2", lambda g: g.update(slots=torch.tensor([0, -2, 0, 0, 0, 0], dtype=torch.int32),
                                   seg_slots=torch.tensor([-2, 0], dtype=torch.int32)), ValueError, "outside"),
    ("slices differ", lambda g: g.update(a=[g["a"], torch.randn(S, R + 1, K)]), ValueError, "share"),
    ("not a tensor", lambda g: g.update(a=[1, 2]), TypeError, "lora_a"),
]


@pytest.mark.parametrize("op", ["bgmv", "sgmv"])
@pytest.mark.parametrize("path", [0, 1], ids=["dispatch", "triton"])
@pytest.mark.parametrize("name, mutate, err, match", SHRINK_BAD, ids=[c[0] for c in SHRINK_BAD])
def test_bad_shrink_calls(op, path, name, mutate, err, match):
    g = good()
    mutate(g)
    with pytest.raises(err, match=match):
        call_shrink(SHRINKS[op][path], op, g)


EXPAND_BAD = [
    ("v fp16", lambda g: g.update(v=g["v"].half()), TypeError, "v has dtype"),
    ("y/b mismatch", lambda g: g.update(y=g["y"].bfloat16()), TypeError, "must match"),
    ("v shape", lambda g: g.update(v=torch.zeros(T, R + 1)), ValueError, "v has shape"),
    ("y too narrow", lambda g: g.update(y=torch.zeros(T, N - 1)), ValueError, "outside y's width"),
    ("non-contiguous y", lambda g: g.update(y=torch.zeros(N, T).t()), ValueError, "contiguous"),
    ("rank > R", lambda g: g.update(ranks=torch.tensor([1, 1, 1, 99])), ValueError, "ranks must lie"),
    ("slot too big", lambda g: g.update(slots=torch.tensor([9, 1, 0, 0, 0, 0], dtype=torch.int32),
                                        seg_slots=torch.tensor([9, 0], dtype=torch.int32)), ValueError, "outside"),
]


@pytest.mark.parametrize("op", ["bgmv", "sgmv"])
@pytest.mark.parametrize("path", [0, 1], ids=["dispatch", "triton"])
@pytest.mark.parametrize("name, mutate, err, match", EXPAND_BAD, ids=[c[0] for c in EXPAND_BAD])
def test_bad_expand_calls_leave_y_untouched(op, path, name, mutate, err, match):
    g = good()
    g["v"] = torch.randn(T, R)
    mutate(g)
    before = g["y"].clone()
    with pytest.raises(err, match=match):
        call_expand(EXPANDS[op][path], op, g)
    assert torch.equal(g["y"], before)


@pytest.mark.parametrize("fn", [pk.sgmv_shrink, sgmv_shrink_triton])
@pytest.mark.parametrize("starts, seg_slots, match", [
    ([0, 2, 5], [0, 1], "from 0 to the token count"),
    ([1, 2, 6], [0, 1], "from 0 to the token count"),
    ([0, 4, 2, 6], [0, 1, 2], "non-decreasing"),
    ([0, 6], [0, 1], "one more entry"),
])
def test_bad_segments(fn, starts, seg_slots, match):
    g = good()
    g["starts"], g["seg_slots"] = torch.tensor(starts), torch.tensor(seg_slots)
    with pytest.raises(ValueError, match=match):
        call_shrink(fn, "sgmv", g)


def test_wrong_offsets_count_and_device():
    g = good()
    with pytest.raises(ValueError, match="2 offsets for 1"):
        call_expand(pk.bgmv_expand, "bgmv", g, offsets=[0, 4])
    with pytest.raises(ValueError, match="runs on CUDA or CPU"):
        pk.bgmv_shrink(g["x"].to("meta"), g["a"], g["slots"], g["scales"], g["ranks"])


@pytest.mark.parametrize("kw", [dict(block_m=8), dict(block_r=24), dict(block_k=0)])
def test_tl_dot_tiles_below_the_gpu_minimum_are_refused(kw):
    # The interpreter would run a tile of 8; the GPU compiler would not: refused everywhere.
    g = good()
    with pytest.raises(ValueError, match="powers of two >= 16"):
        sgmv_shrink_triton(g["x"], g["a"], g["starts"], g["seg_slots"], g["scales"], g["ranks"], **kw)


def test_bgmv_tiles_must_be_powers_of_two():
    g = good()
    with pytest.raises(ValueError, match="powers of two"):
        bgmv_shrink_triton(g["x"], g["a"], g["slots"], g["scales"], g["ranks"], block_k=100)
    with pytest.raises(ValueError, match="powers of two"):
        bgmv_expand_triton(g["v"], g["b"], g["slots"], g["ranks"], g["y"], block_n=96)
