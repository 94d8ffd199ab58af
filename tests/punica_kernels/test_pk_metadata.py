"""build_lora_metadata: one slot list -> segments, per-token slots, sorted order, distinct slots."""

from __future__ import annotations

import pytest
import torch

import punica_kernels as pk


def test_runs_become_segments_without_permuting_tokens():
    m = pk.build_lora_metadata([3, 3, 3, -1, 0, 0, 3, 5], num_slots=6)
    assert m.token_slots.tolist() == [3, 3, 3, -1, 0, 0, 3, 5]
    assert m.seg_starts.tolist() == [0, 3, 4, 6, 7, 8]
    assert m.seg_slots.tolist() == [3, -1, 0, 3, 5]
    assert m.max_segment_len == 3
    assert m.sorted_tokens.tolist() == [4, 5, 0, 1, 2, 6, 7]  # stable sort by slot, -1 left out
    assert m.distinct_slots.tolist() == [0, 3, 5] and m.distinct_slots_list == (0, 3, 5)
    assert m.token_slots.dtype == m.seg_starts.dtype == m.seg_slots.dtype == torch.int32


def test_decode_shapes_depend_only_on_batch_size():
    a = pk.build_lora_metadata([0, 1, 2, 3])
    b = pk.build_lora_metadata([-1, 7, 7, 2])
    assert a.token_slots.shape == b.token_slots.shape == (4,)


def test_empty_and_all_none_batches():
    m = pk.build_lora_metadata([])
    assert m.num_tokens == 0 and m.seg_starts.tolist() == [0] and m.max_segment_len == 0
    m = pk.build_lora_metadata(torch.tensor([-1, -1, -1]))
    assert m.seg_slots.tolist() == [-1] and m.distinct_slots_list == () and m.sorted_tokens.numel() == 0


def test_metadata_drives_both_kernel_families_to_the_same_answer():
    torch.manual_seed(0)
    slots = [2, 2, 2, 2, 0, -1, 1, 1, 1, 2]
    S, R, K = 3, 8, 40
    x, A = torch.randn(10, K), torch.randn(S, R, K)
    ranks, scales = torch.tensor([8, 3, 5]), torch.ones(S)
    m = pk.build_lora_metadata(slots, num_slots=S)
    vb = pk.bgmv_shrink(x, A, m.token_slots, scales, ranks, meta=m)
    vs = pk.sgmv_shrink(x, A, m.seg_starts, m.seg_slots, scales, ranks, max_segment_len=m.max_segment_len, meta=m)
    torch.testing.assert_close(vb, vs, rtol=1e-5, atol=1e-5)
    want = pk.reference.bgmv_shrink(x, A, m.token_slots, scales, ranks)
    torch.testing.assert_close(vb.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad, err, match", [
    ([0, 6], ValueError, "out of range"),
    ([0, -2], ValueError, "invalid"),
    ([0, 1.5], TypeError, "ints"),
    (torch.tensor([0.0, 1.0]), TypeError, "integer"),
])
def test_bad_slot_lists_raise(bad, err, match):
    with pytest.raises(err, match=match):
        pk.build_lora_metadata(bad, num_slots=6)


def test_num_decode_splits_off_the_prefill_runs_relative_to_their_first_row():
    # 3 decode tokens, then chunks of slots 2, 2 (two sequences on one adapter: one run), -1, 0.
    m = pk.build_lora_metadata([2, -1, 2, 2, 2, 2, -1, 0, 0, 0], num_slots=3, num_decode=3)
    assert m.num_decode == 3 and m.decode_slots.tolist() == [2, -1, 2]
    assert m.prefill_seg_starts.tolist() == [0, 3, 4, 7]
    assert m.prefill_seg_slots.tolist() == [2, -1, 0]
    assert m.prefill_max_segment_len == 3 and isinstance(m.prefill_max_segment_len, int)
    assert m.prefill_seg_starts.dtype == m.prefill_seg_slots.dtype == torch.int32
    # The whole batch's runs are unchanged by the split (the CPU path and SGMV callers read them).
    assert m.seg_starts.tolist() == [0, 1, 2, 6, 7, 10]


@pytest.mark.parametrize("num_decode, starts, slots, longest", [
    (None, [0, 2, 3], [1, 0], 2),  # not given: the prefill fields cover every token
    (0, [0, 2, 3], [1, 0], 2),
    (3, [0], [], 0),
])
def test_num_decode_edges(num_decode, starts, slots, longest):
    m = pk.build_lora_metadata([1, 1, 0], num_decode=num_decode)
    assert m.num_decode == num_decode
    assert m.prefill_seg_starts.tolist() == starts and m.prefill_seg_slots.tolist() == slots
    assert m.prefill_max_segment_len == longest
    assert m.decode_slots.numel() == (num_decode or 0)


@pytest.mark.parametrize("num_decode, err", [(4, ValueError), (-1, ValueError), (1.0, TypeError), (True, TypeError)])
def test_bad_num_decode_raises(num_decode, err):
    with pytest.raises(err, match="num_decode"):
        pk.build_lora_metadata([0, 1, 2], num_decode=num_decode)
