"""punica_kernels.kernels._interpreter: under TRITON_INTERPRET=1 a launch patches triton.language
once, however many @triton.jit helpers its programs call, gives the same results, and leaves
triton.language as it found it, also after a launch that failed."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from punica_kernels.kernels import _interpreter
from punica_kernels.kernels._common import INTERPRETED

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="the interpreter's patching (TRITON_INTERPRET=1)")


@triton.jit
def _scaled(x, s):
    return x * s


@triton.jit
def _row_sums_kernel(x_ptr, out_ptr, N: tl.constexpr, CALLS: tl.constexpr):
    row = tl.program_id(0)
    x = tl.load(x_ptr + row * N + tl.arange(0, N))
    acc = tl.zeros([N], dtype=tl.float32)
    for _ in range(CALLS):  # one device-function call per iteration
        acc += _scaled(x, 1.0)
    tl.store(out_ptr + row, tl.sum(acc, 0))


@triton.jit
def _failing_kernel(x_ptr):
    tl.static_assert(False, "refused on purpose")


def _row_sums(x: torch.Tensor, calls: int) -> torch.Tensor:
    out = torch.empty(x.shape[0], dtype=torch.float32)
    _row_sums_kernel[(x.shape[0],)](x, out, N=x.shape[1], CALLS=calls)
    return out


def _builtins_patched(monkeypatch) -> list[int]:
    """Counts the interpreter's walks over a module (one per module a _patch_lang patches)."""
    from triton.runtime import interpreter

    walks = [0]
    original = interpreter._patch_builtin

    def counting(*args, **kwargs):
        walks[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(interpreter, "_patch_builtin", counting)
    return walks


def test_a_launch_patches_once_however_many_helpers_its_programs_call(monkeypatch):
    assert _interpreter.install()  # installed at import; idempotent
    x = torch.randn(4, 16)
    walks = _builtins_patched(monkeypatch)
    few = _row_sums(x, 1)
    after_one = walks[0]
    many = _row_sums(x, 25)  # 4 programs x 25 helper calls, plus tl.sum
    assert walks[0] - after_one == after_one > 0
    torch.testing.assert_close(few, x.sum(1))
    torch.testing.assert_close(many, 25 * x.sum(1))


def test_triton_language_is_restored_after_a_launch_and_after_a_failed_one():
    before = {name: getattr(tl, name) for name in ("sum", "reduce", "range", "load", "static_assert")}
    before_core = {name: getattr(tl.core, name) for name in ("reduce", "add")}
    _row_sums(torch.ones(2, 16), 3)
    with pytest.raises(Exception, match="refused on purpose"):
        _failing_kernel[(1,)](torch.zeros(1))
    assert {name: getattr(tl, name) for name in before} == before
    assert {name: getattr(tl.core, name) for name in before_core} == before_core
    # The next launch patches in full again (a failed launch left no launch open).
    torch.testing.assert_close(_row_sums(torch.ones(3, 16), 2), torch.full((3,), 32.0))
