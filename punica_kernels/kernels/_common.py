"""Device-side tables the launchers pass to the kernels.

Several slices (q, k, v stacks) are separate tensors, so one launch reaches them through a
small int64 table of data pointers, plus a table of each slice's width and output column
offset. The tables are cached by (device, pointers, widths, offsets): the engine's slot stacks
live for the whole run, so after the first step no host-to-device copy happens, which CUDA
graph capture requires.
"""

from __future__ import annotations

import torch

_TABLE_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_TABLE_CACHE_MAX = 4096


def slice_tables(slices: list[torch.Tensor], widths: list[int], offsets: list[int]):
    """-> (int64 [L] data pointers, int64 [2, L] rows (width, column offset)), on the slices' device."""
    device = slices[0].device
    key = (device, tuple(t.data_ptr() for t in slices), tuple(widths), tuple(offsets))
    hit = _TABLE_CACHE.get(key)
    if hit is not None:
        return hit
    if len(_TABLE_CACHE) >= _TABLE_CACHE_MAX:
        _TABLE_CACHE.clear()
    ptrs = torch.tensor([t.data_ptr() for t in slices], dtype=torch.int64, device=device)
    geo = torch.tensor([widths, offsets], dtype=torch.int64, device=device)
    _TABLE_CACHE[key] = (ptrs, geo)
    return ptrs, geo


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
