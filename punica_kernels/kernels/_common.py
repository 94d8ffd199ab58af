"""Device-side tables the launchers pass to the kernels.

Several slices (q, k, v stacks) are separate tensors, so one launch reaches them through a
small int64 table of data pointers, plus a table of each slice's width and output column
offset. The tables are cached by (device, pointers, widths, offsets): the engine's slot stacks
live for the whole run, so after the first step no host-to-device copy happens, which CUDA
graph capture requires.
"""

from __future__ import annotations

import os

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


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether a kernel's tl.dot runs on fp32 tiles (IEEE products) for inputs of `dtype`.

    fp32 inputs always do (TF32 would keep only 10 mantissa bits). bf16 does only under
    TRITON_INTERPRET=1: the interpreter's bf16 tl.dot returns garbage (fp16 is fine), so there
    the tiles are widened first; on a GPU, bf16 tiles go to the tensor cores as they are.
    """
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
