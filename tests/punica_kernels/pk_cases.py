"""Random LoRA batches for the punica_kernels tests (imported by the test modules beside it)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from punica_kernels import reference as ref

#: Where the Triton tests run: CPU tensors (through the interpreter) always, CUDA where present.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def triton_devices() -> list[str]:
    """The DEVICES this process's Triton kernels run on: "cpu" when they were built for the
    interpreter (TRITON_INTERPRET=1 at import), else "cuda" (see conftest.py beside this file)."""
    from punica_kernels.kernels._common import INTERPRETED

    return [d for d in DEVICES if (d == "cpu") == INTERPRETED]


TOL = {  # (rtol, atol) of a result against the float64 reference, by input dtype
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


@dataclass
class Batch:
    x: torch.Tensor  # [T, K]
    a: list[torch.Tensor]  # per slice [S, R, K]; rows past a slot's rank hold NaN
    b: list[torch.Tensor]  # per slice [S, N_i, R]; columns past a slot's rank hold NaN
    ranks: torch.Tensor  # [S] int32
    scales: torch.Tensor  # [S] float32
    token_slots: torch.Tensor  # [T] int32
    seg_starts: torch.Tensor  # [n+1] int32, may contain empty segments
    seg_slots: torch.Tensor  # [n] int32
    v: torch.Tensor  # [L, T, R] fp32 input for the expand tests
    y: torch.Tensor  # [T, width] output buffer with random contents
    offsets: list[int]
    max_segment_len: int

    def to(self, device) -> Batch:
        """A copy with every tensor on `device` (the references run on the CPU original)."""
        def move(val):
            if isinstance(val, torch.Tensor):
                return val.to(device)
            if isinstance(val, list) and val and isinstance(val[0], torch.Tensor):
                return [t.to(device) for t in val]
            return val
        return Batch(**{f.name: move(getattr(self, f.name)) for f in fields(self)})


def make_batch(*, T: int, K: int, S: int, R: int, widths=(None,), dtype=torch.float32, mode="mixed",
               seed: int = 0, ranks=None, y_width=None, offsets=None) -> Batch:
    """mode: "mixed" (random slots, some -1, random ranks), "none" (all -1), "one" (one slot, full rank).

    widths: output width of each expand slice (None = K). Padding past each slot's rank is NaN, so
    any kernel that reads past the true rank produces NaN and fails the comparison.
    """
    g = torch.Generator().manual_seed(seed)
    widths = [K if w is None else w for w in widths]
    L = len(widths)
    if ranks is None:
        ranks = torch.randint(1, R + 1, (S,), generator=g) if mode == "mixed" else torch.full((S,), R)
    ranks = torch.as_tensor(ranks, dtype=torch.int32)
    x = torch.randn(T, K, generator=g).to(dtype)
    a, b = [], []
    for n in widths:
        A = torch.randn(S, R, K, generator=g) / K ** 0.5
        B = torch.randn(S, n, R, generator=g) / R ** 0.5
        for s in range(S):
            A[s, ranks[s]:] = float("nan")
            B[s, :, ranks[s]:] = float("nan")
        a.append(A.to(dtype))
        b.append(B.to(dtype))
    scales = (torch.rand(S, generator=g) + 0.5).float()
    token_slots = _slots(T, mode, S, g)
    # Segments: random cut points (repeats make empty segments), one slot each.
    n_cuts = int(torch.randint(0, max(1, min(T, 12)) + 1, (1,), generator=g))
    cuts = sorted(torch.randint(0, T + 1, (n_cuts,), generator=g).tolist())
    seg_starts = torch.tensor([0, *cuts, T], dtype=torch.int32)
    n_seg = seg_starts.numel() - 1
    seg_slots = _slots(n_seg, mode, S, g)
    v = torch.randn(L, T, R, generator=g)
    if y_width is None:
        y_width = sum(widths)
    y = torch.randn(T, y_width, generator=g).to(dtype)
    max_len = int((seg_starts[1:] - seg_starts[:-1]).max()) if n_seg else 0
    return Batch(x, a, b, ranks, scales, token_slots.to(torch.int32), seg_starts,
                 seg_slots.to(torch.int32), v, y, offsets, max_len)


def _slots(n: int, mode: str, S: int, g: torch.Generator) -> torch.Tensor:
    """n slot indices: all -1 (mode "none"), all the last slot ("one"), or random in [-1, S)."""
    if mode == "none":
        return torch.full((n,), -1)
    if mode == "one":
        return torch.full((n,), S - 1)
    return torch.randint(-1, S, (n,), generator=g)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.cpu().double(), want.cpu().double(), rtol=rtol, atol=atol)


def reference_v(bt: Batch, op: str, single: bool) -> torch.Tensor:
    a = bt.a[0] if single else bt.a
    if op == "bgmv":
        return ref.bgmv_shrink(bt.x, a, bt.token_slots, bt.scales, bt.ranks)
    return ref.sgmv_shrink(bt.x, a, bt.seg_starts, bt.seg_slots, bt.scales, bt.ranks)


def reference_y(bt: Batch, op: str, single: bool) -> torch.Tensor:
    b = bt.b[0] if single else bt.b
    v = bt.v[0] if single else bt.v
    if op == "bgmv":
        return ref.bgmv_expand(v, b, bt.token_slots, bt.ranks, bt.y, bt.offsets)
    return ref.sgmv_expand(v, b, bt.seg_starts, bt.seg_slots, bt.ranks, bt.y, bt.offsets)


def run_shrink(fns: dict, bt: Batch, op: str, single: bool, **kw) -> torch.Tensor:
    """fns maps "bgmv"/"sgmv" to a shrink function with the package's signature."""
    a = bt.a[0] if single else bt.a
    if op == "bgmv":
        return fns["bgmv"](bt.x, a, bt.token_slots, bt.scales, bt.ranks, **kw)
    return fns["sgmv"](bt.x, a, bt.seg_starts, bt.seg_slots, bt.scales, bt.ranks,
                       max_segment_len=bt.max_segment_len, **kw)


def run_expand(fns: dict, bt: Batch, op: str, single: bool, **kw) -> torch.Tensor:
    """Runs the expand on a copy of bt.y and returns that copy."""
    b = bt.b[0] if single else bt.b
    v = bt.v[0] if single else bt.v
    y = bt.y.clone()
    if op == "bgmv":
        out = fns["bgmv"](v, b, bt.token_slots, bt.ranks, y, offsets=bt.offsets, **kw)
    else:
        out = fns["sgmv"](v, b, bt.seg_starts, bt.seg_slots, bt.ranks, y, offsets=bt.offsets,
                          max_segment_len=bt.max_segment_len, **kw)
    assert out is y  # updated in place
    return y


def check_shrink_and_expand(shrink: dict, expand: dict, bt: Batch, op: str, single: bool,
                            dtype=torch.float32, device="cpu") -> None:
    """Shrink and expand of bt (fns as in run_shrink and run_expand), run on `device`, against
    the float64 reference."""
    dbt = bt.to(device)
    assert_close(run_shrink(shrink, dbt, op, single), reference_v(bt, op, single), dtype)
    assert_close(run_expand(expand, dbt, op, single), reference_y(bt, op, single), dtype)


@dataclass(frozen=True)
class Case:
    """A random batch by its sizes and seed (what hypothesis prints for a failing example)."""
    op: str
    T: int
    K: int
    S: int
    R: int
    n_slices: int
    mode: str
    seed: int

    def check(self, shrink: dict, expand: dict, device="cpu") -> None:
        """Its batch (expand widths K, K/2, K/3 for 1 to 3 slices) through check_shrink_and_expand."""
        widths = tuple(max(1, self.K // (i + 1)) for i in range(self.n_slices))
        bt = make_batch(T=self.T, K=self.K, S=self.S, R=self.R, widths=widths, mode=self.mode, seed=self.seed)
        check_shrink_and_expand(shrink, expand, bt, self.op, single=self.n_slices == 1, device=device)


def random_cases(*, max_T: int, max_K: int, max_S: int, max_R: int, examples: int):
    """Decorates a test taking `case`: hypothesis draws that many Cases up to these sizes (T from 0,
    the other sizes from 1; "mixed" mode twice as often as each of the others)."""
    cases = st.builds(
        Case,
        op=st.sampled_from(["bgmv", "sgmv"]),
        T=st.integers(0, max_T),
        K=st.integers(1, max_K),
        S=st.integers(1, max_S),
        R=st.integers(1, max_R),
        n_slices=st.integers(1, 3),
        mode=st.sampled_from(["mixed", "mixed", "none", "one"]),
        seed=st.integers(0, 2**16),
    )
    return lambda test: settings(max_examples=examples, deadline=None,
                                 suppress_health_check=[HealthCheck.too_slow])(given(case=cases)(test))
