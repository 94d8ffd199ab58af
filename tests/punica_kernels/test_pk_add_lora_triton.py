"""add_lora on the Triton kernels (impl="triton", and the default on CUDA): a mixed batch's decode
rows through BGMV and its prefill chunks through SGMV (build_lora_metadata(num_decode=)), against
the float64 reference and the CPU path; the impl switch and its errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pk_cases import assert_close, make_batch, triton_devices

import punica_kernels as pk
from punica_kernels import reference as ref

# (decode slots, prefill chunks as (slot, length)): slot -1 tokens in both parts, chunks of one
# adapter side by side (one segment), a chunk longer than SGMV's 32-row tile, empty parts.
LAYOUTS = {
    "mixed": ([2, -1, 0, 3, 2], [(1, 5), (-1, 3), (0, 7), (0, 2), (3, 1)]),
    "long-chunk": ([1], [(2, 37), (-1, 2)]),
    "decode-only": ([0, 3, -1, 1, 1, 2], []),
    "prefill-only": ([], [(3, 4), (2, 9), (-1, 2)]),
    "one-decode-token": ([2], []),
    "one-prefill-token": ([], [(0, 1)]),
    "all-none": ([-1, -1], [(-1, 6)]),
}
RANKS = [16, 3, 1, 9]  # adapters of different ranks in one R=16 stack; padding past each is NaN


def _slots(layout: str) -> tuple[list[int], int]:
    decode, chunks = LAYOUTS[layout]
    return decode + [s for s, n in chunks for _ in range(n)], len(decode)


def _stack(widths, offsets, y_width, T, K=40, dtype=torch.float32, seed=0):
    """A make_batch over RANKS (its x, stacks, y; the tests bring their own slots)."""
    return make_batch(T=T, K=K, S=len(RANKS), R=16, ranks=RANKS, widths=widths, y_width=y_width,
                      offsets=offsets, dtype=dtype, seed=seed)


def _reference(bt, slots) -> torch.Tensor:
    """add_lora's semantics per token: BGMV shrink then expand, in float64."""
    token_slots = torch.tensor(slots, dtype=torch.int32)
    v = ref.bgmv_shrink(bt.x, bt.a, token_slots, bt.scales, bt.ranks)
    return ref.bgmv_expand(v, bt.b, token_slots, bt.ranks, bt.y, bt.offsets)


# (slice widths, offsets, y width): one slice; q/k/v packed; gate/up at offsets in a wider y.
SLICES = {
    "one": ((40,), None, None),
    "qkv": ((48, 16, 16), None, None),
    "gate-up-offsets": ((24, 24), [3, 40], 70),
}


@pytest.mark.parametrize("slices", SLICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mixed_batch_matches_reference_and_cpu_path(layout, slices, device):
    slots, nd = _slots(layout)
    widths, offsets, y_width = SLICES[slices]
    bt = _stack(widths, offsets, y_width, T=len(slots), seed=len(slots) + len(widths))
    stack = pk.lora_stack(bt.a, bt.b, bt.scales, bt.ranks, offsets)
    meta = pk.build_lora_metadata(slots, num_slots=len(RANKS), num_decode=nd)
    want = _reference(bt, slots)

    d = bt.to(device)
    y = d.y.clone()
    dstack = pk.lora_stack(d.a, d.b, d.scales, d.ranks, offsets)
    dmeta = pk.build_lora_metadata(slots, num_slots=len(RANKS), num_decode=nd, device=device)
    assert pk.add_lora(y, d.x, dstack, meta=dmeta, impl="triton") is y
    assert torch.isfinite(y).all()  # no NaN padding read
    assert_close(y, want, torch.float32)

    y_cpu = bt.y.clone()
    pk.add_lora(y_cpu, bt.x, stack, meta=meta, impl="cpu")
    assert_close(y, y_cpu, torch.float32)


@pytest.mark.parametrize("num_decode", [None, 0, 3, 8])
def test_every_split_of_one_batch_gives_the_same_answer(num_decode, device):
    # None: BGMV over every token (callers that do not say where decode ends); 0: SGMV over all.
    slots = [1, 1, 0, -1, 3, 3, 3, 2]
    bt = _stack((40,), None, None, T=len(slots), seed=4)
    d = bt.to(device)
    meta = pk.build_lora_metadata(slots, num_slots=len(RANKS), num_decode=num_decode, device=device)
    y = d.y.clone()
    pk.add_lora(y, d.x, d.a[0], d.b[0], d.scales, d.ranks, meta=meta, impl="triton")
    assert_close(y, _reference(bt, slots), torch.float32)


def test_half_precision_mixed_batch(device):
    slots, nd = _slots("mixed")
    bt = _stack((48, 16, 16), None, None, T=len(slots), dtype=torch.float16, seed=7)
    d = bt.to(device)
    meta = pk.build_lora_metadata(slots, num_slots=len(RANKS), num_decode=nd, device=device)
    y = d.y.clone()
    pk.add_lora(y, d.x, pk.lora_stack(d.a, d.b, d.scales, d.ranks), meta=meta, impl="triton")
    assert y.dtype == torch.float16
    assert_close(y, _reference(bt, slots), torch.float16)


def test_cpu_only_stack_forms_are_refused_on_triton(device):
    # int8 and bf16-with-fp32-activations stacks are the CPU path's; impl="cpu" runs them there.
    slots = [0, 1, -1]
    bt = _stack((40,), None, None, T=3, seed=8)
    a = [torch.nan_to_num(t) for t in bt.a]
    b = [torch.nan_to_num(t) for t in bt.b]
    meta = pk.build_lora_metadata(slots, num_slots=len(RANKS), num_decode=3)
    qa, sa = pk.quantize_rows(a[0])
    qb, sb = pk.quantize_rows(b[0])
    int8 = pk.lora_stack(qa, qb, bt.scales, bt.ranks, a_row_scales=sa, b_row_scales=sb)
    bf16 = pk.lora_stack(a[0].bfloat16(), b[0].bfloat16(), bt.scales, bt.ranks)
    for stack in (int8, bf16):
        pk.add_lora(bt.y.clone(), bt.x, stack, meta=meta, impl="cpu")
    dmeta = pk.build_lora_metadata(slots, num_slots=len(RANKS), num_decode=3, device=device)
    x, y = bt.x.to(device), bt.y.to(device)
    with pytest.raises(TypeError, match="int8 LoRA stacks are a CPU form"):
        pk.add_lora(y, x, pk.lora_stack(qa.to(device), qb.to(device), bt.scales.to(device), bt.ranks.to(device),
                                        a_row_scales=sa.to(device), b_row_scales=sb.to(device)),
                    meta=dmeta, impl="triton")
    with pytest.raises(TypeError, match="must match"):
        pk.add_lora(y, x, pk.lora_stack(a[0].bfloat16().to(device), b[0].bfloat16().to(device),
                                        bt.scales.to(device), bt.ranks.to(device)), meta=dmeta, impl="triton")


def test_impl_values_and_mismatched_metadata_are_refused(device):
    bt = _stack((40,), None, None, T=4, seed=9).to(device)
    stack = pk.lora_stack(bt.a, bt.b, bt.scales, bt.ranks)
    meta = pk.build_lora_metadata([0, 1, 2, 3], num_slots=len(RANKS), num_decode=2, device=device)
    with pytest.raises(ValueError, match="impl must be None, 'triton' or 'cpu'"):
        pk.add_lora(bt.y.clone(), bt.x, stack, meta=meta, impl="cuda")
    with pytest.raises(ValueError, match="impl must be"):
        pk.bgmv_shrink(bt.x, bt.a[0], meta.token_slots, bt.scales, bt.ranks, impl="gpu")
    short = pk.build_lora_metadata([0, 1, 2], num_slots=len(RANKS), num_decode=1, device=device)
    with pytest.raises(ValueError, match="one row per token"):
        pk.add_lora(bt.y.clone(), bt.x, stack, meta=short, impl="triton")


@pytest.mark.parametrize("op", ["bgmv", "sgmv"])
def test_the_four_ops_take_impl(op, device):
    # The same call through the CPU path and through Triton gives the same v and y.
    bt = _stack((40,), None, None, T=9, seed=10)
    outs = []
    for impl, dev in (("cpu", "cpu"), ("triton", device)):
        d = bt.to(dev)
        meta = pk.build_lora_metadata(bt.token_slots, num_slots=len(RANKS), device=dev)
        a, b, v = d.a[0], d.b[0], d.v[0]
        if op == "bgmv":
            vv = pk.bgmv_shrink(d.x, a, meta.token_slots, d.scales, d.ranks, impl=impl)
            y = pk.bgmv_expand(v, b, meta.token_slots, d.ranks, d.y.clone(), impl=impl)
        else:
            seg = (meta.seg_starts, meta.seg_slots)
            vv = pk.sgmv_shrink(d.x, a, *seg, d.scales, d.ranks, max_segment_len=meta.max_segment_len, impl=impl)
            y = pk.sgmv_expand(v, b, *seg, d.ranks, d.y.clone(), max_segment_len=meta.max_segment_len, impl=impl)
        outs.append((vv, y))
    assert_close(outs[1][0], outs[0][0], torch.float32)
    assert_close(outs[1][1], outs[0][1], torch.float32)


def test_triton_on_cpu_without_the_interpreter_says_how_to_fix_it():
    # A fresh process without TRITON_INTERPRET: the kernels are built for the GPU, so CPU tensors
    # get a RuntimeError naming the switch, while impl=None (the CPU path) still runs.
    script = """
import torch, punica_kernels as pk
x, y = torch.randn(2, 8), torch.zeros(2, 8)
a, b = torch.randn(1, 4, 8), torch.randn(1, 8, 4)
s, r = torch.ones(1), torch.tensor([4])
meta = pk.build_lora_metadata([0, -1], num_slots=1, num_decode=1)
pk.add_lora(y, x, a, b, s, r, meta=meta)
assert y[0].abs().sum() > 0 and y[1].abs().sum() == 0
for call in (lambda: pk.add_lora(y, x, a, b, s, r, meta=meta, impl="triton"),
             lambda: pk.bgmv_shrink(x, a, meta.token_slots, s, r, impl="triton")):
    try:
        call()
    except RuntimeError as e:
        print("RuntimeError:", e)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all("set TRITON_INTERPRET=1" in line for line in lines), out.stdout


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decode=st.lists(st.integers(-1, len(RANKS) - 1), max_size=6),
       chunks=st.lists(st.tuples(st.integers(-1, len(RANKS) - 1), st.integers(1, 40)), max_size=4),
       n_slices=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_random_mixed_batches(decode, chunks, n_slices, seed):
    # hypothesis forbids function-scoped fixtures in @given tests: the devices are looped here.
    slots = decode + [s for s, n in chunks for _ in range(n)]
    widths = (40, 16, 8)[:n_slices]
    bt = _stack(widths, None, None, T=len(slots), K=24, seed=seed)
    devices = triton_devices()
    if not devices:
        pytest.skip("the kernels were compiled for the GPU and no GPU is present")
    for device in devices:
        d = bt.to(device)
        meta = pk.build_lora_metadata(slots, num_slots=len(RANKS), num_decode=len(decode), device=device)
        y = d.y.clone()
        pk.add_lora(y, d.x, pk.lora_stack(d.a, d.b, d.scales, d.ranks), meta=meta, impl="triton")
        assert_close(y, _reference(bt, slots), torch.float32)
