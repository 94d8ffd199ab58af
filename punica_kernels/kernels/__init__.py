"""Triton kernels and their launchers: one file per op (kernel, checking launcher, Semantics)."""

from .bgmv_expand import bgmv_expand_triton
from .bgmv_shrink import bgmv_shrink_triton
from .grouped_expand import grouped_expand_triton
from .grouped_shrink import grouped_shrink_triton
from .sgmv_expand import sgmv_expand_triton
from .sgmv_shrink import sgmv_shrink_triton

__all__ = ["bgmv_shrink_triton", "bgmv_expand_triton", "sgmv_shrink_triton", "sgmv_expand_triton",
           "grouped_shrink_triton", "grouped_expand_triton"]
