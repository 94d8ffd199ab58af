"""The `device` fixture of the Triton tests: every such test runs on CPU tensors through the
Triton interpreter, and again on CUDA tensors (compiled kernels) where a GPU is present.

Triton builds a kernel for the interpreter or for the GPU when its module is imported, by
TRITON_INTERPRET (tests/conftest.py sets it to 1 unless the environment already says otherwise),
so one process runs one of the two: on a GPU machine `TRITON_INTERPRET=0 pytest ...` runs the
"cuda" cases compiled and skips the "cpu" ones, the default run the other way round. Where no GPU
is present there is no "cuda" case at all, so nothing here is skipped."""

from __future__ import annotations

import pytest
import torch
from pk_cases import DEVICES


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Where a Triton test puts its tensors."""
    from punica_kernels.kernels._common import INTERPRETED

    if request.param == "cpu" and not INTERPRETED:
        pytest.skip("Triton on CPU tensors needs the interpreter; this process compiled the kernels "
                    "for the GPU (TRITON_INTERPRET unset or 0)")
    if request.param == "cuda" and INTERPRETED:
        pytest.skip("this process built the kernels for the interpreter (TRITON_INTERPRET=1); "
                    "run with TRITON_INTERPRET=0 for the compiled CUDA kernels")
    return torch.device(request.param)
