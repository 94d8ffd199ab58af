"""The hand-written CPU kernel for decode- and chat-prefill-shaped add_lora calls (punica_kernels/csrc, loaded by
punica_kernels.cpu_native): built here with the machine's compiler, it must give the float64
reference's result for every shape the engine's decode steps produce, never read past a slot's
rank (padding is NaN), and leave everything else to the torch path."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import punica_kernels as pk
from engine import omp_threads
from punica_kernels import cpu_native
from tests.punica_kernels.pk_cases import assert_close, make_batch

pytestmark = pytest.mark.usefixtures("needs_c_compiler")  # missing: skip, or fail under CI=true


def _reference(bt):
    v = pk.reference.bgmv_shrink(bt.x, bt.a, bt.token_slots, bt.scales, bt.ranks)
    return pk.reference.bgmv_expand(v, bt.b, bt.token_slots, bt.ranks, bt.y, bt.offsets)


def _runs(slots_per_run: list[tuple[int, int]]) -> torch.Tensor:
    """Token slots as consecutive runs: [(slot, length), ...] (the engine orders decodes by slot)."""
    return torch.tensor([s for s, n in slots_per_run for _ in range(n)], dtype=torch.int32)


def test_the_kernel_builds_and_loads_here():
    assert cpu_native.library() is not None


@pytest.mark.parametrize("K,R,widths", [(576, 16, (576, 192, 192)), (129, 64, (40, 24)), (1536, 8, (576,)),
                                        (33, 4, (17,))], ids=lambda v: str(v))
def test_decode_batches_match_the_reference(K, R, widths):
    runs = [(3, 1), (-1, 2), (0, 8), (5, 3), (1, 1), (7, 2), (-1, 12), (6, 5), (2, 1)]
    slots = _runs(runs)
    S = 8
    ranks = [R, 1, max(1, R // 2), R, 3 if R >= 3 else 1, R, 0, min(R, 5)]  # rank 0: a slot with nothing to add
    bt = make_batch(T=slots.numel(), K=K, S=S, R=R, widths=widths, ranks=ranks, seed=K + R)
    bt.token_slots = slots
    width = sum(widths) + 7
    bt.y = torch.randn(slots.numel(), width)
    bt.offsets = [width - sum(widths[: i + 1]) for i in range(len(widths))]  # unpacked, reversed order
    meta = pk.build_lora_metadata(slots, num_slots=S)
    args = pk._checks.check_add_lora(y := bt.y.clone(), bt.x, bt.a, bt.b, bt.scales, bt.ranks, bt.offsets)
    assert cpu_native.add_lora_f32(args, meta)  # the kernel took it
    assert_close(y, _reference(bt), torch.float32)
    # The public op routes the same call through the kernel too.
    y2 = pk.add_lora(bt.y.clone(), bt.x, bt.a, bt.b, bt.scales, bt.ranks, meta=meta, offsets=bt.offsets)
    assert torch.equal(y2, y)


def test_prompt_length_runs_in_several_passes_match_the_reference():
    """Prefill chunks of chat-length prompts (runs longer than one 8-token pass) go through the
    kernel too, pass after pass over the same slot's weights."""
    slots = _runs([(2, 37), (0, 9), (-1, 5), (3, cpu_native.MAX_RUN), (1, 17)])
    bt = make_batch(T=slots.numel(), K=576, S=4, R=16, widths=(576, 192, 192), seed=11)
    bt.token_slots = slots
    meta = pk.build_lora_metadata(slots, num_slots=4)
    args = pk._checks.check_add_lora(y := bt.y.clone(), bt.x, bt.a, bt.b, bt.scales, bt.ranks, bt.offsets)
    assert cpu_native.add_lora_f32(args, meta)
    assert_close(y, _reference(bt), torch.float32)


def test_unordered_slots_and_a_slot_on_several_runs():
    bt = make_batch(T=40, K=200, S=12, R=16, widths=(200, 48), seed=7)
    meta = pk.build_lora_metadata(bt.token_slots, num_slots=12)
    assert cpu_native.max_adapter_run(meta) <= cpu_native.MAX_RUN
    y = pk.add_lora(bt.y.clone(), bt.x, bt.a, bt.b, bt.scales, bt.ranks, meta=meta, offsets=bt.offsets)
    assert_close(y, _reference(bt), torch.float32)


def test_long_runs_other_dtypes_and_wide_ranks_take_the_torch_path(monkeypatch):
    long_run = make_batch(T=cpu_native.MAX_RUN + 1, K=64, S=4, R=8, mode="one", seed=1)
    meta = pk.build_lora_metadata(long_run.token_slots, num_slots=4)
    args = pk._checks.check_add_lora(long_run.y.clone(), long_run.x, long_run.a, long_run.b, long_run.scales,
                                     long_run.ranks)
    assert not cpu_native.add_lora_f32(args, meta)
    bf16 = make_batch(T=6, K=64, S=4, R=8, dtype=torch.bfloat16, seed=2)
    meta = pk.build_lora_metadata(bf16.token_slots, num_slots=4)
    args = pk._checks.check_add_lora(bf16.y.clone(), bf16.x, bf16.a, bf16.b, bf16.scales, bf16.ranks)
    assert not cpu_native.add_lora_f32(args, meta)
    wide = make_batch(T=6, K=64, S=2, R=cpu_native.MAX_RANK + 8, seed=3)
    meta = pk.build_lora_metadata(wide.token_slots, num_slots=2)
    args = pk._checks.check_add_lora(wide.y.clone(), wide.x, wide.a, wide.b, wide.scales, wide.ranks)
    assert not cpu_native.add_lora_f32(args, meta)
    # Without the library (switched off, or no compiler) the torch path gives the same answer.
    bt = make_batch(T=24, K=129, S=9, R=16, widths=(129, 40), seed=4)
    meta = pk.build_lora_metadata(bt.token_slots, num_slots=9)
    native = pk.add_lora(bt.y.clone(), bt.x, bt.a, bt.b, bt.scales, bt.ranks, meta=meta)
    monkeypatch.setattr(cpu_native, "library", lambda: None)
    fallback = pk.add_lora(bt.y.clone(), bt.x, bt.a, bt.b, bt.scales, bt.ranks, meta=meta)
    assert_close(native, fallback, torch.float32)
    assert_close(fallback, _reference(bt), torch.float32)


@pytest.mark.parametrize("torch_path", [False, True], ids=["kernel", "torch"])
@pytest.mark.parametrize("K,R", [(576, 16), (200, 64), (33, 24)], ids=lambda v: str(v))
def test_bf16_stacks_with_fp32_activations(monkeypatch, torch_path, K, R):
    """add_lora's one mixed form (the engine's adapter storage where the kernel is built): bf16
    stacks, fp32 x and y. The result is the reference's on the bf16 values widened to fp32, through
    the kernel (widening in registers, any run length) and through the torch path alike; padding
    past each rank (NaN) is never read. Ranks and widths with and without whole blocks of 16 (the
    kernel takes bf16 weights 16 at a time where it can)."""
    slots = _runs([(1, 3), (-1, 2), (0, 70), (2, 1), (3, 9)])  # one run longer than MAX_RUN
    ranks = [R, 1, max(1, R // 2), R - 1]
    bt = make_batch(T=slots.numel(), K=K, S=4, R=R, widths=(K, 40), ranks=ranks, seed=21 + K)
    bt.token_slots = slots
    a16 = [a.bfloat16() for a in bt.a]
    b16 = [b.bfloat16() for b in bt.b]
    bt.a, bt.b = [a.float() for a in a16], [b.float() for b in b16]  # the values the op sees
    meta = pk.build_lora_metadata(slots, num_slots=4)
    if torch_path:
        monkeypatch.setattr(cpu_native, "library", lambda: None)
    else:
        args = pk._checks.check_add_lora(bt.y.clone(), bt.x, a16, b16, bt.scales, bt.ranks, bt.offsets)
        assert cpu_native.add_lora_f32(args, meta)  # the kernel takes it
    y = pk.add_lora(bt.y.clone(), bt.x, a16, b16, bt.scales, bt.ranks, meta=meta, offsets=bt.offsets)
    assert y.dtype == torch.float32
    assert_close(y, _reference(bt), torch.float32)


def test_other_mixed_dtypes_are_refused():
    bt = make_batch(T=4, K=32, S=2, R=4, seed=5)
    meta = pk.build_lora_metadata(bt.token_slots, num_slots=2)
    with pytest.raises(TypeError, match="bfloat16"):
        pk.add_lora(bt.y.clone(), bt.x, [a.half() for a in bt.a], [b.half() for b in bt.b], bt.scales, bt.ranks,
                    meta=meta)
    with pytest.raises(TypeError):  # bf16 A with fp32 B
        pk.add_lora(bt.y.clone(), bt.x, [a.bfloat16() for a in bt.a], bt.b, bt.scales, bt.ranks, meta=meta)


def test_a_prepared_stack_gives_the_same_result_and_sees_slot_writes():
    """`lora_stack` checks a layer's stacks once (the engine makes the same call every step);
    add_lora on it equals add_lora on the raw tensors, and slots rewritten in place afterwards
    (weights, ranks) are what the next call reads."""
    bt = make_batch(T=20, K=576, S=6, R=16, widths=(576, 192, 192), seed=31)
    bt.a, bt.b = [a.bfloat16() for a in bt.a], [b.bfloat16() for b in bt.b]
    meta = pk.build_lora_metadata(bt.token_slots, num_slots=6)
    stack = pk.lora_stack(bt.a, bt.b, bt.scales, bt.ranks, bt.offsets)
    raw = pk.add_lora(bt.y.clone(), bt.x, bt.a, bt.b, bt.scales, bt.ranks, meta=meta, offsets=bt.offsets)
    assert torch.equal(pk.add_lora(bt.y.clone(), bt.x, stack, meta=meta), raw)
    slot = int(bt.token_slots[0])
    bt.ranks[slot] = 0  # the slot emptied in place: its tokens get nothing added
    for a in bt.a:
        a[(slot + 1) % 6].mul_(2)
    y = pk.add_lora(bt.y.clone(), bt.x, stack, meta=meta)
    assert torch.equal(y, pk.add_lora(bt.y.clone(), bt.x, bt.a, bt.b, bt.scales, bt.ranks, meta=meta,
                                      offsets=bt.offsets))
    assert torch.equal(y[0], bt.y[0]) and not torch.equal(y, raw)


def test_bad_calls_on_a_prepared_stack():
    bt = make_batch(T=4, K=64, S=3, R=8, widths=(64,), seed=2)
    meta = pk.build_lora_metadata(bt.token_slots, num_slots=3)
    stack = pk.lora_stack(bt.a, bt.b, bt.scales, bt.ranks)
    with pytest.raises(TypeError, match="LoRAStack"):
        pk.add_lora(bt.y.clone(), bt.x, stack, bt.b, meta=meta)
    with pytest.raises(ValueError, match="x's width"):
        pk.add_lora(torch.zeros(4, 3), torch.zeros(4, 65), stack, meta=meta)
    with pytest.raises(ValueError, match="outside y's width"):
        pk.add_lora(torch.zeros(4, 10), bt.x, stack, meta=meta)
    with pytest.raises(TypeError, match="bfloat16"):
        pk.add_lora(bt.y.clone().half(), bt.x.half(), stack, meta=meta)  # fp32 stacks, fp16 activations
    bt.ranks[1] = 9  # written past R after the stack was checked: caught at the call
    y = bt.y.clone()
    with pytest.raises(ValueError, match=r"ranks must lie in \[0, 8\]"):
        pk.add_lora(y, bt.x, stack, meta=meta)
    assert torch.equal(y, bt.y)


def _int8_stack(bt, ranks):
    """bt's weights as an int8 stack (quantize_rows; each slot's B at its rank, int8_b_write),
    and bt rewritten to the dequantized values the op sees. Rows of A past each slot's rank get
    weight 127 and a NaN scale, and B's entries past N * rank 127, so a kernel that reads them
    shows it."""
    qa = [pk.quantize_rows(torch.nan_to_num(a, nan=0.0)) for a in bt.a]
    qb = [pk.quantize_rows(torch.nan_to_num(b, nan=0.0)) for b in bt.b]  # rows: outputs, over R (zeros past r)
    packed = []
    for (q, rs), (qbl, _) in zip(qa, qb):
        for s, r in enumerate(ranks):
            q[s, r:], rs[s, r:] = 127, float("nan")
        pb = torch.full_like(qbl, 127)
        for s, r in enumerate(ranks):
            pk.int8_b_write(pb, s, qbl[s, :, :r])
        packed.append(pb)
    bt.a = [q.float() * rs.unsqueeze(-1) for q, rs in qa]
    bt.b = [q.float() * rs.unsqueeze(-1) for q, rs in qb]
    for b in bt.b:
        for s, r in enumerate(ranks):
            b[s, :, r:] = float("nan")
    return pk.lora_stack([q for q, _ in qa], packed, bt.scales, bt.ranks, bt.offsets,
                         a_row_scales=[rs for _, rs in qa], b_row_scales=[rs for _, rs in qb])


@pytest.mark.parametrize("n,rank", [(40, 16), (33, 7), (5, 1), (8, 0), (1536, 64)])
def test_int8_b_holds_a_slot_in_its_first_n_rank_bytes(n, rank):
    """int8_b_write puts a slot's [N, rank] B in the first N * rank bytes of its block, rank pairs
    first (output n's two values side by side), an odd rank's last column after them; the rest of
    the stack is untouched, and int8_b_read gives the values back."""
    gen = torch.Generator().manual_seed(n + rank)
    q = torch.randint(-127, 128, (n, rank), generator=gen).to(torch.int8)
    stack = torch.full((3, n, 64), 99, dtype=torch.int8)
    pk.int8_b_write(stack, 1, q)
    block = stack[1].flatten()
    for j in range(rank):
        at = j // 2 * 2 * n + (torch.arange(n) if rank % 2 and j == rank - 1 else 2 * torch.arange(n) + j % 2)
        assert torch.equal(block[at], q[:, j]), j
    assert (block[n * rank:] == 99).all() and (stack[0] == 99).all() and (stack[2] == 99).all()
    assert torch.equal(pk.int8_b_read(stack, 1, rank), q)
    with pytest.raises(ValueError, match="rank 65 outside"):
        pk.int8_b_read(stack, 1, 65)


@pytest.mark.parametrize("torch_path", [False, True], ids=["kernel", "torch"])
@pytest.mark.parametrize("K,R", [(576, 16), (1536, 64), (200, 24), (33, 8), (576, 64)], ids=lambda v: str(v))
def test_int8_stacks_with_row_scales(monkeypatch, torch_path, K, R):
    """add_lora's int8 form (the engine's adapter storage where the kernel is built): int8 stacks
    with fp32 row scales, fp32 x and y. The result is the reference's on the dequantized weights,
    to 1e-4 of the adapter term's size (the kernel rounds x and the intermediate to 16 bits for
    its integer products), through the kernel (any run length) and the torch path alike; nothing
    past a slot's rank is read. Ranks below, at and across blocks of 16, and rank-16 slots in a
    rank-64 stack (the engine's default R); odd ranks (B's last rank a column of its own) and
    ranks not a multiple of 16; output widths with and without whole blocks of 8 and 32 (the
    expand's tails); K with and without whole blocks of 16."""
    slots = _runs([(1, 3), (-1, 2), (0, 70), (2, 1), (3, 9)])  # one run longer than MAX_RUN
    ranks = [R, 1, max(1, R // 2), R - 1] if (K, R) != (576, 64) else [16, 16, 8, 16]
    bt = make_batch(T=slots.numel(), K=K, S=4, R=R, widths=(K, 40), ranks=ranks, seed=41 + K)
    bt.token_slots = slots
    stack = _int8_stack(bt, ranks)
    meta = pk.build_lora_metadata(slots, num_slots=4)
    if torch_path:
        monkeypatch.setattr(cpu_native, "library", lambda: None)
    else:
        assert cpu_native.add_lora_f32(pk._checks.check_add_lora(bt.y.clone(), bt.x, stack), meta)  # the kernel takes it
    y = pk.add_lora(bt.y.clone(), bt.x, stack, meta=meta)
    want = _reference(bt)
    term = (want - bt.y).abs().max()
    assert y.dtype == torch.float32 and term > 0.1
    assert (y - want).abs().max() < 1e-4 * term
    assert torch.equal(y[slots == -1], bt.y[slots == -1])


def test_int8_results_do_not_depend_on_threads_or_token_blocks():
    """int8 stacks: the kernel splits a call's (run, slice) items into one contiguous share per
    thread (a share that begins inside a run rounds that run's x rows again, into its own room)
    and multiplies up to four tokens of a run per pass over the weights; neither may change a bit.
    One, two and three threads give the same result for a step of 24 distinct adapters beside
    runs of every length up to two passes, and for one 40-token prompt (five runs of three slices:
    two and three threads split it inside a run); a token whose x is all zero (an all-zero
    intermediate) inside a run adds nothing while its neighbours in the same pass are added."""
    runs = [(s, 1) for s in range(24)] + [(24, 2), (-1, 3), (25, 3), (26, 5), (27, 7), (28, 16), (29, 13)]
    slots = _runs(runs)
    S = 30
    ranks = [16, 7, 1, 12] * 7 + [16, 9]
    bt = make_batch(T=slots.numel(), K=576, S=S, R=16, widths=(576, 192, 40), ranks=ranks, seed=5)
    bt.token_slots = slots
    zero = int((slots == 28).nonzero()[2])  # the third token of the 16-token run
    bt.x[zero] = 0.0
    gomp = omp_threads._libgomp()  # this thread's OpenMP thread count alone (torch.set_num_threads is process-wide)
    if gomp is None:
        pytest.skip("torch's OpenMP runtime is not libgomp")

    def on_1_2_3_threads(b) -> torch.Tensor:
        """The call on b's tokens with 1, 2 and 3 threads; all three the same bits."""
        stack, meta = _int8_stack(b, ranks), pk.build_lora_metadata(b.token_slots, num_slots=S)
        threads, got = gomp.omp_get_max_threads(), []
        try:
            for n in (1, 2, 3):
                gomp.omp_set_num_threads(n)
                got.append(pk.add_lora(b.y.clone(), b.x, stack, meta=meta))
        finally:
            gomp.omp_set_num_threads(threads)
        assert all(torch.equal(g, got[0]) for g in got[1:])
        return got[0]

    y = on_1_2_3_threads(bt)
    assert torch.equal(y[zero], bt.y[zero]) and torch.equal(y[slots == -1], bt.y[slots == -1])
    want = _reference(bt)
    term = (want - bt.y).abs().max()
    assert (y - want).abs().max() < 1e-4 * term
    assert ((y - bt.y)[slots == 28].abs().amax(1) > 0).sum() == 15  # every other token of that run added

    prompt = torch.full((40,), 3, dtype=torch.int32)
    bp = make_batch(T=40, K=576, S=S, R=16, widths=(576, 192, 40), ranks=ranks, seed=6)
    bp.token_slots = prompt
    y = on_1_2_3_threads(bp)
    want = _reference(bp)  # after _int8_stack, which puts the int8 weights' values in bp
    assert (y - want).abs().max() < 1e-4 * (want - bp.y).abs().max()


def test_a_step_bound_from_its_slot_list_matches_one_bound_from_metadata():
    """StepCall.for_slots (the engine's CPU steps: no LoRAMetadata built) binds the same tokens,
    slot count and longest run as StepCall.for_meta, gives the same result, and refuses a slot
    outside [-1, S)."""
    token_slots = [-1, 3, 3, 0, 0, 0, -1, -1, 2] + [1] * 70
    bt = make_batch(T=len(token_slots), K=64, S=4, R=8, widths=(64, 16), seed=9)
    bt.token_slots = torch.tensor(token_slots, dtype=torch.int32)
    meta = pk.build_lora_metadata(token_slots, num_slots=4)
    a, b = cpu_native.StepCall.for_meta(meta), cpu_native.StepCall.for_slots(token_slots, 4)
    assert (b.num_tokens, b.num_slots, b.max_run) == (a.num_tokens, a.num_slots, a.max_run) == (79, 4, 70)
    assert torch.equal(a.slots, b.slots)
    stack = _int8_stack(bt, [8, 8, 8, 8])
    ya, yb = bt.y.clone(), bt.y.clone()
    assert a(stack, bt.x, ya) and b(stack, bt.x, yb)
    assert torch.equal(ya, yb) and not torch.equal(ya, bt.y)
    for bad in ([0, 4], [-2, 0]):
        with pytest.raises(ValueError, match="token slots must be in"):
            cpu_native.StepCall.for_slots(bad, 4)


def test_a_call_on_a_resolved_stack_matches_the_checked_call_and_passes_what_it_cannot_take():
    """StepCall.run (the engine's calls, on stacks resolved once with kernel_stack) gives the
    bits of StepCall.__call__ on contiguous activations, and answers False, writing nothing, for
    what it cannot take: a y whose rows are strided, x of another width or dtype, y narrower than
    the stack, another token count, a stack the kernel does not take; __call__ still serves the
    strided y. Both go through the step's entry (its run list and scratch built once)."""
    token_slots = [-1, 2, 2, 0, 1, 1, 1, 3]
    bt = make_batch(T=len(token_slots), K=64, S=4, R=8, widths=(64, 16), seed=11)
    bt.token_slots = torch.tensor(token_slots, dtype=torch.int32)
    stack = _int8_stack(bt, [8, 3, 8, 5])
    call = cpu_native.StepCall.for_slots(token_slots, 4)
    ks = cpu_native.kernel_stack(stack)
    assert ks is cpu_native.kernel_stack(stack)  # built once per stack
    want, got = bt.y.clone(), bt.y.clone()
    assert call(stack, bt.x, want) and call.run(ks, bt.x, got)
    assert torch.equal(got, want) and not torch.equal(got, bt.y)

    wide = torch.zeros(len(token_slots), 2 * bt.y.shape[1])
    strided = wide[:, : bt.y.shape[1]].copy_(bt.y)
    refused = [(ks, bt.x, strided), (ks, bt.x[:, :32].contiguous(), bt.y.clone()), (ks, bt.x.double(), bt.y.clone()),
               (ks, bt.x, bt.y[:, :40].clone()), (ks, bt.x[:4].contiguous(), bt.y[:4].clone()),
               (ks, bt.x.t().contiguous().t(), bt.y.clone()), (None, bt.x, bt.y.clone())]
    for k, x, y in refused:
        before = y.clone()
        assert not call.run(k, x, y)
        assert torch.equal(y, before)
    assert call(stack, bt.x, strided)
    assert torch.equal(strided, want)
    # A build without the step entry (an earlier source, bench/lora_kernel_ab.py's peer) takes the
    # one-call entry: the same bits.
    lib = cpu_native.library()
    one_call = cpu_native.StepCall.for_slots(token_slots, 4,
                                             lib=SimpleNamespace(tessera_add_lora_f32=lib.tessera_add_lora_f32))
    again = bt.y.clone()
    assert one_call.run(ks, bt.x, again) and torch.equal(again, want)


def test_int8_stacks_stay_close_to_the_float_weights():
    """Rows quantized to int8 keep the adapter term within 2% of the float weights' (what an int8
    engine's adapters do to the model), on the engine's q/k/v shapes."""
    slots = _runs([(s, 4) for s in range(8)])
    bt = make_batch(T=slots.numel(), K=576, S=8, R=16, widths=(576, 192, 192), mode="one", seed=3)
    bt.token_slots = slots
    want = _reference(bt) - bt.y
    stack = _int8_stack(bt, [16] * 8)
    got = pk.add_lora(bt.y.clone(), bt.x, stack, meta=pk.build_lora_metadata(slots, num_slots=8)) - bt.y
    assert (got - want).norm() < 0.02 * want.norm()


def test_quantize_rows():
    w = torch.randn(3, 5, 40) * torch.tensor([1e-3, 1.0, 50.0]).view(3, 1, 1)
    w[1, 2] = 0.0  # an all-zero row
    q, rs = pk.quantize_rows(w)
    assert q.dtype == torch.int8 and rs.dtype == torch.float32 and rs.shape == (3, 5)
    assert q.abs().max() == 127 and rs[1, 2] == 0 and torch.equal(q[1, 2], torch.zeros(40, dtype=torch.int8))
    err = (q.float() * rs.unsqueeze(-1) - w).abs()
    assert (err <= rs.unsqueeze(-1) / 2 * (1 + 1e-5)).all()  # within half a step of each row's grid
    with pytest.raises(TypeError, match="float"):
        pk.quantize_rows(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="NaN"):
        pk.quantize_rows(torch.tensor([[1.0, float("nan")]]))


def test_bad_int8_stacks_are_refused():
    bt = make_batch(T=4, K=32, S=2, R=4, widths=(32, 8), mode="one", seed=6)
    (qa, ra), (qb, rb) = pk.quantize_rows(bt.a[0]), pk.quantize_rows(bt.b[0])
    with pytest.raises(TypeError, match="a_row_scales"):
        pk.lora_stack(qa, qb, bt.scales, bt.ranks)
    with pytest.raises(ValueError, match=r"a_row_scales\[0\] has shape"):
        pk.lora_stack(qa, qb, bt.scales, bt.ranks, a_row_scales=ra[:, :2].contiguous(), b_row_scales=rb)
    with pytest.raises(TypeError, match="every lora_a and lora_b"):
        pk.lora_stack(qa, bt.b[0], bt.scales, bt.ranks, a_row_scales=ra, b_row_scales=rb)
    with pytest.raises(TypeError, match="int8 stacks only"):
        pk.lora_stack(bt.a[0], bt.b[0], bt.scales, bt.ranks, a_row_scales=ra, b_row_scales=rb)
    stack = pk.lora_stack(qa, qb, bt.scales, bt.ranks, a_row_scales=ra, b_row_scales=rb)
    meta = pk.build_lora_metadata(bt.token_slots, num_slots=2)
    with pytest.raises(TypeError, match="int8 with float32 x and y"):
        pk.add_lora(torch.zeros(4, 8, dtype=torch.bfloat16), bt.x.bfloat16(), stack, meta=meta)


def test_the_plain_c_paths_match_the_reference(monkeypatch):
    """The kernel built without SIMD (baseline x86-64: what a CPU without AVX2 + FMA runs, never
    run on this machine's native build) gives the reference's result too, for fp32, bf16 and
    int8 stacks."""
    plain = cpu_native.load_library("x86-64")
    assert plain is not None
    monkeypatch.setattr(cpu_native, "library", lambda: plain)
    slots = _runs([(1, 3), (-1, 2), (0, 11), (2, 1), (3, 9)])
    ranks = [16, 1, 8, 15]
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        bt = make_batch(T=slots.numel(), K=200, S=4, R=16, widths=(200, 40), ranks=ranks, seed=7)
        bt.token_slots = slots
        meta = pk.build_lora_metadata(slots, num_slots=4)
        if dtype == torch.int8:
            stack = _int8_stack(bt, ranks)
        else:
            a, b = [t.to(dtype) for t in bt.a], [t.to(dtype) for t in bt.b]
            bt.a, bt.b = [t.float() for t in a], [t.float() for t in b]
            stack = pk.lora_stack(a, b, bt.scales, bt.ranks, bt.offsets)
        assert cpu_native.add_lora_f32(pk._checks.check_add_lora(bt.y.clone(), bt.x, stack), meta)
        y = pk.add_lora(bt.y.clone(), bt.x, stack, meta=meta)
        assert_close(y, _reference(bt), torch.float32)


def _cpu_flags() -> set[str]:
    try:
        return {f for line in open("/proc/cpuinfo") if line.startswith("flags") for f in line.split()[2:]}
    except OSError:
        return set()


@pytest.mark.skipif("avx512bw" not in _cpu_flags(), reason="needs AVX-512BW: the 16-lane int8 paths")
def test_int8_avx512_paths_give_the_avx2_builds_bits(monkeypatch):
    """int8 stacks: this machine's build (AVX-512BW, VNNI where present: 16-row shrink blocks read
    row after row) gives bit for bit the AVX2 build's result
    (8-lane integer products), whatever the ranks (below, at and across the 16-row blocks, up to
    64) and K (with and without whole blocks of 32 and 16 inputs)."""
    avx2 = cpu_native.load_library("x86-64-v3")
    native = cpu_native.library()
    assert avx2 is not None and native is not None
    slots = _runs([(1, 3), (-1, 2), (0, 11), (2, 1), (3, 9)])
    meta = pk.build_lora_metadata(slots, num_slots=4)
    for K, R, ranks in ((576, 16, [16, 1, 8, 15]), (1536, 64, [64, 17, 33, 48]), (200, 24, [24, 23, 5, 16]),
                        (40, 32, [32, 31, 2, 9])):
        bt = make_batch(T=slots.numel(), K=K, S=4, R=R, widths=(K, 40, 8), ranks=ranks, seed=K + R)
        bt.token_slots = slots
        stack = _int8_stack(bt, ranks)
        got = {}
        for name, lib in (("avx2", avx2), ("native", native)):
            monkeypatch.setattr(cpu_native, "library", lambda lib=lib: lib)
            got[name] = pk.add_lora(bt.y.clone(), bt.x, stack, meta=meta)
        assert torch.equal(got["avx2"], got["native"]), (K, R, ranks)
        assert (got["native"] - bt.y).abs().max() > 0.1  # the adapters did something
