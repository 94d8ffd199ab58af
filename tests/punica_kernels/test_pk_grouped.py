"""Decode rows grouped by adapter (punica_kernels.group_decode_tokens and the grouped shrink /
expand kernels, add_lora's decode path on Triton) against the float64 reference, on every
`device` (tests/conftest.py: CPU tensors through the interpreter, CUDA where present): one
adapter for every row, all distinct, rows without adapter, ranks below 16 and at the stack's
maximum, q/k/v slices, the three dtypes; the split-K reduction, determinism, and intermediates
that are written whole (no pre-zeroed buffer)."""

from __future__ import annotations

import pytest
import torch
from pk_cases import assert_close, make_batch

import punica_kernels as pk
from punica_kernels import reference as ref
from punica_kernels.kernels import grouped_expand_triton, grouped_shrink_triton
from punica_kernels.kernels import _common
from punica_kernels.kernels.sgmv_shrink import sgmv_shrink_into

S, R = 6, 32
RANKS = [32, 5, 16, 1, 20, 32]  # below 16 (tl.dot's minimum tile), at it, and at the stack's R


def _slots(layout: str, T: int) -> list[int]:
    if layout == "one":  # every row on one adapter
        return [2] * T
    if layout == "distinct":  # as many adapters as fit, in a shuffled order
        return [(i * 5 + 3) % S for i in range(T)]
    g = torch.Generator().manual_seed(T)  # "mixed": random slots, -1 among them
    slots = torch.randint(-1, S, (T,), generator=g).tolist()
    slots[0] = -1
    return slots


def _reference(bt, slots) -> torch.Tensor:
    token_slots = torch.tensor(slots, dtype=torch.int32)
    v = ref.bgmv_shrink(bt.x, bt.a, token_slots, bt.scales, bt.ranks)
    return ref.bgmv_expand(v, bt.b, token_slots, bt.ranks, bt.y, bt.offsets)


def _batch(T, widths=(48, 16, 16), dtype=torch.float32, K=72, offsets=None, y_width=None, seed=0):
    return make_batch(T=T, K=K, S=S, R=R, ranks=RANKS, widths=widths, dtype=dtype, offsets=offsets,
                      y_width=y_width, seed=seed)


def test_grouping_lists_each_slots_rows_in_order_and_the_rows_without_adapter_last():
    slots = torch.tensor([3, -1, 0, 3, 1, -1, 3, 0], dtype=torch.int32)
    g = pk.group_decode_tokens(slots, 5)
    order, bounds = g.order.tolist(), g.bounds.tolist()
    assert bounds == [0, 2, 3, 3, 6, 6, 8]  # slots 0..4, then the -1 rows, then T
    assert order == [2, 7, 4, 0, 3, 6, 1, 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T", [1, 7, 64])
@pytest.mark.parametrize("layout", ["one", "distinct", "mixed"])
def test_decode_rows_match_reference(layout, T, dtype, device):
    slots = _slots(layout, T)
    bt = _batch(T, dtype=dtype, seed=T)
    d = bt.to(device)
    meta = pk.build_lora_metadata(slots, num_slots=S, num_decode=T, device=device)
    y = d.y.clone()
    assert pk.add_lora(y, d.x, pk.lora_stack(d.a, d.b, d.scales, d.ranks), meta=meta, impl="triton") is y
    assert y.dtype == dtype and torch.isfinite(y).all()  # no NaN padding past a rank was read
    assert_close(y, _reference(bt, slots), dtype)
    untouched = torch.tensor([s == -1 for s in slots])
    assert torch.equal(y.cpu()[untouched], bt.y[untouched])  # rows without adapter: bit for bit


def test_slices_at_offsets_leave_other_columns_alone(device):
    slots = [1, -1, 4, 1, 0, 4, 4]
    bt = _batch(len(slots), widths=(40, 40), offsets=[5, 60], y_width=110, seed=3)
    d = bt.to(device)
    meta = pk.build_lora_metadata(slots, num_slots=S, num_decode=len(slots), device=device)
    y = d.y.clone()
    pk.add_lora(y, d.x, pk.lora_stack(d.a, d.b, d.scales, d.ranks, [5, 60]), meta=meta, impl="triton")
    assert_close(y, _reference(bt, slots), torch.float32)
    y = y.cpu()
    untouched = torch.cat([y[:, :5], y[:, 45:60], y[:, 100:]], 1)
    assert torch.equal(untouched, torch.cat([bt.y[:, :5], bt.y[:, 45:60], bt.y[:, 100:]], 1))


@pytest.mark.parametrize("split_k", [1, 3, 4])
def test_split_k_shrink_writes_every_element_and_resets_its_counters(split_k, device):
    # K = 100 in tiles of 16: the splits cover 7 tiles unevenly. v starts as NaN: every element
    # (the -1 rows' and those past each rank included) must be written.
    slots = [0, -1, 3, 0, 5, 5, 2, -1, 0]
    bt = _batch(len(slots), K=100, seed=5)
    d = bt.to(device)
    token_slots = torch.tensor(slots, dtype=torch.int32, device=device)
    groups = pk.group_decode_tokens(token_slots, S)
    v = torch.full((3, len(slots), R), float("nan"), device=device)
    grouped_shrink_triton(d.x, d.a, groups, d.scales, d.ranks, v, split_k=split_k, block_k=16)
    assert_close(v, ref.bgmv_shrink(bt.x, bt.a, token_slots.cpu(), bt.scales, bt.ranks), torch.float32)
    assert not _common.zeroed_counters(torch.device(device), 0).any()  # the next launch starts from zero


@pytest.mark.parametrize("split_k", [1, 4])
def test_repeated_calls_are_bit_identical(split_k, device):
    slots = [2] * 40 + [-1, 1, 1, 5] * 6
    bt = _batch(len(slots), K=256, dtype=torch.float16, seed=6)
    d = bt.to(device)
    groups = pk.group_decode_tokens(torch.tensor(slots, dtype=torch.int32, device=device), S)
    outs = []
    for _ in range(2):
        v = torch.empty(3, len(slots), R, device=device)
        grouped_shrink_triton(d.x, d.a, groups, d.scales, d.ranks, v, split_k=split_k, block_k=32)
        y = grouped_expand_triton(v, d.b, groups, d.ranks, d.y.clone())
        outs.append((v, y))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert_close(outs[0][1], _reference(bt, slots), torch.float16)


def test_a_grouping_for_other_rows_is_refused(device):
    bt = _batch(4, seed=7).to(device)
    groups = pk.group_decode_tokens(torch.tensor([0, 1, 2], dtype=torch.int32, device=device), S)
    with pytest.raises(ValueError, match="groups cover 3 rows"):
        grouped_expand_triton(bt.v, bt.b, groups, bt.ranks, bt.y.clone())


def test_sgmv_shrink_writes_every_element(device):
    # Segments without adapter and rank blocks past an adapter's rank get zeros from the kernel.
    bt = _batch(20, seed=8)
    d = bt.to(device)
    starts = torch.tensor([0, 3, 3, 11, 20], dtype=torch.int32)
    seg_slots = torch.tensor([1, 4, -1, 0], dtype=torch.int32)
    v = torch.full((3, 20, R), float("nan"), device=device)
    sgmv_shrink_into(d.x, d.a, starts.to(device), seg_slots.to(device), d.scales, d.ranks, v, max_segment_len=9)
    assert_close(v, ref.sgmv_shrink(bt.x, bt.a, starts, seg_slots, bt.scales, bt.ranks), torch.float32)


def test_the_steps_grouping_is_reused_by_every_call(device):
    # A caller that groups once per step (the engine's batch) sets meta.decode_groups; the result
    # is the same as add_lora grouping the rows itself.
    slots = [4, 4, -1, 0, 4]
    bt = _batch(len(slots), seed=9)
    d = bt.to(device)
    meta = pk.build_lora_metadata(slots, num_slots=S, num_decode=len(slots), device=device)
    stack = pk.lora_stack(d.a, d.b, d.scales, d.ranks)
    y_own = pk.add_lora(d.y.clone(), d.x, stack, meta=meta, impl="triton")
    meta.decode_groups = pk.group_decode_tokens(meta.decode_slots, S)
    y_shared = pk.add_lora(d.y.clone(), d.x, stack, meta=meta, impl="triton")
    assert torch.equal(y_own, y_shared)
    assert_close(y_shared, _reference(bt, slots), torch.float32)


def test_wide_ranks_over_several_row_and_rank_tiles(device):
    # R = 128: the shrink's rank tile is 128 wide with 32-row tiles, the expand loops over two
    # 64-wide rank tiles; 40 rows mostly on one adapter take two row tiles.
    ranks = [128, 70, 9]
    slots = [0] * 30 + [1, 2, -1, 1, 0, 2, 2, 1, 0, 0]
    bt = make_batch(T=len(slots), K=48, S=3, R=128, ranks=ranks, widths=(40, 24), seed=10)
    d = bt.to(device)
    meta = pk.build_lora_metadata(slots, num_slots=3, num_decode=len(slots), device=device)
    y = pk.add_lora(d.y.clone(), d.x, pk.lora_stack(d.a, d.b, d.scales, d.ranks), meta=meta, impl="triton")
    assert_close(y, _reference(bt, slots), torch.float32)
