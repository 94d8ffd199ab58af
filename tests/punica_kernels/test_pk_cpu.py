"""The CPU path behind the dispatcher (CPU tensors) against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from pk_cases import (
    assert_close,
    check_shrink_and_expand,
    make_batch,
    random_cases,
    reference_v,
    reference_y,
    run_expand,
    run_shrink,
)

import punica_kernels as pk
from punica_kernels import cpu

SHRINK = {"bgmv": pk.bgmv_shrink, "sgmv": pk.sgmv_shrink}
EXPAND = {"bgmv": pk.bgmv_expand, "sgmv": pk.sgmv_expand}

SHAPES = [(1, 2049, 1, 1), (37, 129, 7, 16), (300, 65, 64, 8), (9, 2049, 5, 128),
          (32, 576, 32, 16), (32, 4096, 32, 16)]


@pytest.mark.parametrize("op", ["bgmv", "sgmv"])
@pytest.mark.parametrize("mode", ["mixed", "none", "one"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-K{}-S{}-R{}".format(*s))
def test_cpu_path_matches_reference(op, mode, dtype, shape):
    T, K, S, R = shape
    bt = make_batch(T=T, K=K, S=S, R=R, mode=mode, dtype=dtype, seed=T + K + S)
    check_shrink_and_expand(SHRINK, EXPAND, bt, op, single=True, dtype=dtype)


@pytest.mark.parametrize("op", ["bgmv", "sgmv"])
def test_cpu_multi_slice_and_offsets(op):
    bt = make_batch(T=21, K=96, S=5, R=16, widths=(96, 32, 32), y_width=200, offsets=[0, 120, 160], seed=2)
    v = run_shrink(SHRINK, bt, op, single=False)
    assert v.shape == (3, 21, 16)
    assert_close(v, reference_v(bt, op, single=False), torch.float32)
    y = run_expand(EXPAND, bt, op, single=False)
    assert_close(y, reference_y(bt, op, single=False), torch.float32)
    assert torch.equal(y[:, 96:120], bt.y[:, 96:120]) and torch.equal(y[:, 192:], bt.y[:, 192:])


def test_cpu_sgmv_prefill_segments_use_views_and_match():
    # Long segments (prefill) take the one-matmul-per-segment branch; check it explicitly.
    ranks = [4, 16, 1]
    bt = make_batch(T=200, K=130, S=3, R=16, ranks=ranks, seed=4)
    bt.seg_starts = torch.tensor([0, 90, 90, 150, 200], dtype=torch.int32)
    bt.seg_slots = torch.tensor([2, 0, -1, 1], dtype=torch.int32)
    bt.max_segment_len = 90
    assert cpu._long_segments(cpu._segments(bt.seg_starts, bt.seg_slots), 200)
    check_shrink_and_expand(SHRINK, EXPAND, bt, "sgmv", single=True)


def _plan_forms_batch(singletons, dtype=torch.float32, **kw):
    # A long run on one slot (its own matmul on a view of x), many scattered tokens on another
    # (its own matmul on gathered rows), and a padded block of the rest, with -1 tokens between.
    T = 400
    slots = torch.full((T,), -1)
    slots[10:210] = 5
    slots[torch.arange(212, 392, 2)] = 2
    slots[[0, 3, 7, 397, 399][:len(singletons)]] = torch.tensor(singletons)
    slots[[1, 4, 395]] = 1
    bt = make_batch(T=T, K=96, S=24, R=16, ranks=[16] * 24, dtype=dtype, seed=7, **kw)
    bt.token_slots = slots.to(torch.int32)
    return bt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("singletons,block", [([0, 3, 7, 20], "gathered"), ([0, 3, 4, 6, 7], "range with holes")])
def test_cpu_slot_major_plan_forms_match(dtype, singletons, block):
    bt = _plan_forms_batch(singletons, dtype, widths=(96, 40))
    (g,) = cpu.plan_tokens(bt.token_slots, bt.ranks)
    assert {b.slot: b.run for b in g.big} == {5: (10, 210), 2: None}
    assert g.m == 3 and g.pad_mask is not None
    if block == "gathered":
        assert torch.equal(g.block_slots, torch.tensor([0, 1, 3, 7, 20]))
    else:  # slots 0, 1, 3, 4, 6, 7 read as the range [0, 8); big slots 2 and 5 are padding there
        assert g.block_slots == slice(0, 8)
    check_shrink_and_expand(SHRINK, EXPAND, bt, "bgmv", single=False, dtype=dtype)


def test_cpu_similar_prompts_stay_one_block():
    # A prefill step of prompts of similar length on distinct adapters: one padded block, not one
    # matmul per prompt.
    lens = [30, 25, 28, 33, 19, 31]
    slots = torch.cat([torch.full((n,), s) for s, n in zip([4, 0, 5, 1, 3, 2], lens)])
    bt = make_batch(T=int(slots.numel()), K=64, S=6, R=8, ranks=[8] * 6, seed=11)
    bt.token_slots = slots.to(torch.int32)
    (g,) = cpu.plan_tokens(bt.token_slots, bt.ranks)
    assert not g.big and g.m == 33 and g.block_slots == slice(0, 6)
    assert_close(run_expand(EXPAND, bt, "bgmv", single=True), reference_y(bt, "bgmv", single=True), torch.float32)


def test_cpu_slot_major_block_reads_a_slot_range_in_place():
    # Distinct adapters on consecutive slots (the engine's decode step): the block is a view.
    bt = make_batch(T=32, K=64, S=32, R=8, ranks=[8] * 32, seed=8)
    bt.token_slots = torch.randperm(32, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    (g,) = cpu.plan_tokens(bt.token_slots, bt.ranks)
    assert g.block_slots == slice(0, 32) and g.m == 1 and g.pad_mask is None and not g.big
    check_shrink_and_expand(SHRINK, EXPAND, bt, "bgmv", single=True)


def test_meta_reuse_across_layers_and_rank_changes():
    bt = make_batch(T=40, K=64, S=6, R=16, seed=6)
    meta = pk.build_lora_metadata(bt.token_slots, num_slots=6)
    v1 = pk.bgmv_shrink(bt.x, bt.a[0], meta.token_slots, bt.scales, bt.ranks, meta=meta)
    assert_close(v1, reference_v(bt, "bgmv", True), torch.float32)
    # New ranks for the same slots (an adapter swapped into a slot): the cached grouping must follow.
    bt.ranks = torch.tensor([16, 1, 2, 3, 4, 5], dtype=torch.int32)
    bt.a[0] = torch.nan_to_num(bt.a[0], nan=0.0)
    v2 = pk.bgmv_shrink(bt.x, bt.a[0], meta.token_slots, bt.scales, bt.ranks, meta=meta)
    assert_close(v2, reference_v(bt, "bgmv", True), torch.float32)
    y = bt.y.clone()
    pk.sgmv_expand(bt.v[0], torch.nan_to_num(bt.b[0]), meta.seg_starts, meta.seg_slots, bt.ranks, y,
                   max_segment_len=meta.max_segment_len, meta=meta)
    want = pk.reference.bgmv_expand(bt.v[0], torch.nan_to_num(bt.b[0]), bt.token_slots, bt.ranks, bt.y)
    assert_close(y, want, torch.float32)


@random_cases(max_T=120, max_K=600, max_S=40, max_R=64, examples=60)
def test_cpu_hypothesis_shapes(case):
    case.check(SHRINK, EXPAND)


def _reference_add_lora(bt, single):
    a = bt.a[0] if single else bt.a
    b = bt.b[0] if single else bt.b
    v = pk.reference.bgmv_shrink(bt.x, a, bt.token_slots, bt.scales, bt.ranks)
    return pk.reference.bgmv_expand(v, b, bt.token_slots, bt.ranks, bt.y, bt.offsets)


@pytest.mark.parametrize("mode", ["mixed", "none", "one"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 129, 1, 4), (37, 129, 7, 16), (300, 65, 64, 8), (32, 576, 32, 16)],
                         ids=lambda s: "T{}-K{}-S{}-R{}".format(*s))
def test_cpu_add_lora_matches_shrink_then_expand(mode, dtype, shape):
    T, K, S, R = shape
    bt = make_batch(T=T, K=K, S=S, R=R, widths=(K, 40, 24), dtype=dtype, mode=mode, seed=T + S)
    meta = pk.build_lora_metadata(bt.token_slots, num_slots=S)
    y = pk.add_lora(bt.y.clone(), bt.x, bt.a, bt.b, bt.scales, bt.ranks, meta=meta, offsets=bt.offsets)
    if dtype == torch.bfloat16:
        # Two bf16 roundings (the product, then y) where the separate ops' tests round once.
        torch.testing.assert_close(y.double(), _reference_add_lora(bt, single=False).double(), rtol=0.03, atol=0.03)
    else:
        assert_close(y, _reference_add_lora(bt, single=False), dtype)


def test_cpu_add_lora_every_plan_form_and_unpacked_offsets():
    bt = _plan_forms_batch([0, 3, 7, 20], widths=(40, 24), y_width=100, offsets=[60, 0])
    meta = pk.build_lora_metadata(bt.token_slots, num_slots=24)
    y = pk.add_lora(bt.y.clone(), bt.x, bt.a, bt.b, bt.scales, bt.ranks, meta=meta, offsets=bt.offsets)
    assert_close(y, _reference_add_lora(bt, single=False), torch.float32)
    # One stack per side (not a sequence) works the same.
    y1 = pk.add_lora(bt.y.clone(), bt.x, bt.a[0], bt.b[0], bt.scales, bt.ranks, meta=meta, offsets=bt.offsets[0])
    ref = pk.reference.bgmv_expand(pk.reference.bgmv_shrink(bt.x, bt.a[0], bt.token_slots, bt.scales, bt.ranks),
                                   bt.b[0], bt.token_slots, bt.ranks, bt.y, bt.offsets[0])
    assert_close(y1, ref, torch.float32)


def test_cpu_add_lora_refuses_mismatched_slices():
    bt = make_batch(T=8, K=32, S=4, R=8, widths=(32, 16), seed=10)
    meta = pk.build_lora_metadata(bt.token_slots, num_slots=4)
    with pytest.raises(ValueError, match="same number of slices"):
        pk.add_lora(bt.y, bt.x, bt.a, bt.b[:1], bt.scales, bt.ranks, meta=meta)
    with pytest.raises(TypeError, match="dtype"):
        pk.add_lora(bt.y, bt.x, [a.half() for a in bt.a], bt.b, bt.scales, bt.ranks, meta=meta)


@pytest.mark.parametrize("offsets", [None, [60, 0]], ids=["packed", "unpacked"])
def test_cpu_add_lora_slot_sorted_decode_reads_views(offsets):
    # The engine orders decode tokens by slot (no adapter first): each rank group's padded block
    # is then one run of the batch, read and written through views of x and y.
    S = 6
    slots = torch.tensor([-1, -1, -1] + [s for s in range(S) for _ in range(2)], dtype=torch.int32)
    bt = make_batch(T=slots.numel(), K=40, S=S, R=8, widths=(40, 20), y_width=100, offsets=offsets,
                    ranks=[8] * S, seed=11)
    bt.token_slots = slots
    meta = pk.build_lora_metadata(slots, num_slots=S)
    (group,) = pk.cpu.plan_for(meta, bt.ranks)
    assert group.run == (3, slots.numel()) and group.pad_mask is None
    y = pk.add_lora(bt.y.clone(), bt.x, bt.a, bt.b, bt.scales, bt.ranks, meta=meta, offsets=offsets)
    want = _reference_add_lora(bt, single=False)
    assert_close(y, want, torch.float32)
    assert torch.equal(y[:3], bt.y[:3])  # tokens without an adapter are untouched
