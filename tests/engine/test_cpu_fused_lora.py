"""The CPU backend's fused LoRA linears (CpuLoRABatch.linear): where a batch takes the C int8,
Q4_1 or AMX kernel, the LoRA kernel's term is added inside that kernel's call. It must give exactly the
bits of the base product followed by the LoRA kernel's own call, for every group of a layer,
every token count the two kernels serve and every mix of adapters and base tokens, whatever the
thread count; refuse a bad call as the LoRA call does; and an engine with it must answer exactly
as one without it."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine import omp_threads
from engine.backends.cpu import CpuBackend, CpuLoRABatch, kernel_stacks_of
from engine.backends.cpu import int8 as cpu_int8
from engine.backends.cpu import q4 as cpu_q4
from engine.backends.cpu.linear import AmxInt8Linear, Int8KernelLinear, Q4Linear, StepKind, compose_int8
from engine.config import EngineConfig
from engine.lora.layers import LoRASlots
from engine.lora.source import LocalDirectoryAdapterSource
from engine.lora.weights import GROUPS, load_lora_weights
from engine.model.decoder import DecoderModel
from engine.sampling_params import GenerationRequest, SamplingParams
from engine.scheduler import SchedulerOutput
from tests.requirements import require_c_compiler

from .conftest import chat

DEMO = Path(__file__).resolve().parents[2] / "platform" / "tessera" / "demo_adapters"
ADAPTERS = ("json-answer", "pirate", "upper")


def _layer_linears(smollm_checkpoint, wide: str):
    """Layer 4's four linears, each as a WidthDispatch of the checkpoint's Q4_1 blocks up to 1 row,
    then (`wide` "int8") the C int8 kernel up to 8 rows or ("amx") the int8 kernel up to 1 row and
    the AMX kernel beyond, and LoRA slots holding the three demo adapters (int8 stacks, the
    stacks' rank 64: their ranks 16, 8 and 4 mixed)."""
    require_c_compiler()
    if cpu_q4.library() is None or cpu_int8.library() is None:
        pytest.skip("no C int8 or Q4_1 kernel on this CPU")
    if wide == "amx" and cpu_int8.amx_library() is None:
        pytest.skip("no AMX on this CPU")
    cfg, weights, _ = smollm_checkpoint
    backend = CpuBackend(EngineConfig(weight_format="int8"))
    model = DecoderModel(cfg, weights, backend=backend)  # layers left pending: composed below
    parts = dataclasses.replace(backend.int8_parts(), amx_kernel=wide == "amx")
    layer = model.layers[4]
    linears = {}
    for group, pending in (("qkv", layer.qkv_proj), ("o", layer.o_proj), ("gate_up", layer.gate_up_proj),
                           ("down", layer.down_proj)):
        assert parts.q4(pending) and parts.int8(pending)
        linears[group] = compose_int8(pending, parts, int8_max_rows=8 if wide == "int8" else 1, q4_max_rows=1,
                                      dense=torch.float32, exact_prefill=True, step=StepKind())
        assert [type(m) for _, m in linears[group].bands] == [Q4Linear, Int8KernelLinear]
        assert isinstance(linears[group].wide, AmxInt8Linear) == (wide == "amx")
    slots = LoRASlots(cfg, 3, 64, torch.int8)
    for i, name in enumerate(ADAPTERS):
        slots.write(i, load_lora_weights(DEMO / name, name, cfg, max_rank=64, dtype=torch.int8))
    return linears, slots


@pytest.fixture(scope="module")
def layer_linears(smollm_checkpoint):
    """_layer_linears with the C int8 kernel up to 8 rows."""
    return _layer_linears(smollm_checkpoint, "int8")


@pytest.fixture(scope="module")
def amx_layer_linears(smollm_checkpoint):
    """_layer_linears with the AMX kernel past one row (skipped without AMX)."""
    return _layer_linears(smollm_checkpoint, "amx")


@pytest.fixture(params=["layer_linears", "amx_layer_linears"])
def any_layer_linears(request):
    """Each composition whose kernels have a fused entry past one row (AMX where the CPU has it)."""
    return request.getfixturevalue(request.param)


TOKEN_SLOTS = [[0], [2], [-1], [1, 1], [-1, 0], [0, 0, 1, 2, 2], [-1, -1, 0, 1, 1, 2, 2, 2], [-1] * 8, [2] * 8,
               [-1] * 3 + [0] * 9 + [1] * 6 + [2] * 14]


@pytest.mark.parametrize("token_slots", TOKEN_SLOTS, ids=str)
def test_a_fused_linear_gives_the_bits_of_the_two_calls(any_layer_linears, token_slots):
    """1 token (the Q4_1 kernel) and 2-8 tokens (the int8 kernel; with AMX, the AMX kernel, also at
    32 tokens), adapters mixed with base tokens and alone, pirate's attention-only groups included:
    lin(x) then the LoRA call, and the fused call, give the same bits; the term is really there
    (the output moves off the base product where a token has an adapter with that group)."""
    linears, slots = any_layer_linears
    # past the int8 band without AMX: the dense copy, which has no fused entry (the two calls)
    fusable = len(token_slots) <= 8 or isinstance(linears["o"].wide, AmxInt8Linear)
    stacks = kernel_stacks_of(slots)
    g = torch.Generator().manual_seed(len(token_slots))
    calls = {"fused": 0}
    for group in GROUPS:
        lin = linears[group]
        x = torch.randn(len(token_slots), lin.in_features, generator=g)
        fused_batch = CpuLoRABatch(slots, token_slots, SchedulerOutput(), stacks)
        plain_batch = CpuLoRABatch(slots, token_slots, SchedulerOutput(), stacks, fused=False)
        args = fused_batch.native.fused(stacks[4][group][1], x, lin.out_features)
        assert args is not None
        calls["fused"] += lin.lora_forward(x, args) is not None
        got, want = fused_batch.linear(4, group, lin, x), plain_batch.linear(4, group, lin, x)
        assert torch.equal(got, want), group
        base = lin(x)
        with_term = [t for t, s in enumerate(token_slots) if s >= 0 and slots.rank_in(s, 4, group) > 0]
        assert all(not torch.equal(got[t], base[t]) for t in with_term), group
        assert all(torch.equal(got[t], base[t]) for t in range(len(token_slots)) if t not in with_term), group
    assert calls["fused"] == (len(GROUPS) if fusable else 0)  # every call took a fused entry


def test_fused_results_do_not_depend_on_the_thread_count(any_layer_linears):
    """The base rows and the LoRA items are shared between the region's threads: one, two and
    three threads give the same bits (one token: its slices shared too; eight tokens)."""
    linears, slots = any_layer_linears
    stacks = kernel_stacks_of(slots)
    gomp = omp_threads._libgomp()
    if gomp is None:
        pytest.skip("torch's OpenMP runtime is not libgomp")
    threads = gomp.omp_get_max_threads()
    g = torch.Generator().manual_seed(3)
    for token_slots in ([0], [-1, 0, 0, 1, 2, 2, 2, 2]):
        batch = CpuLoRABatch(slots, token_slots, SchedulerOutput(), stacks)
        for group in ("qkv", "gate_up", "down"):
            x = torch.randn(len(token_slots), linears[group].in_features, generator=g)
            got = []
            try:
                for n in (1, 2, 3):
                    gomp.omp_set_num_threads(n)
                    got.append(batch.linear(4, group, linears[group], x))
            finally:
                gomp.omp_set_num_threads(threads)
            assert all(torch.equal(y, got[0]) for y in got[1:]), (token_slots, group)


def test_what_a_fused_entry_cannot_take_goes_the_two_calls_way(layer_linears):
    """Wider batches than the int8 band (the dense copies have no fused entry), x of another
    dtype or not contiguous, an output narrower than the stack: no fused arguments or no fused
    call, and CpuLoRABatch.linear still gives lin(x) plus the term. A rank outside the stack is
    refused by the fused entry as by the LoRA call."""
    linears, slots = layer_linears
    stacks = kernel_stacks_of(slots)
    lin, ks = linears["o"], stacks[4]["o"][1]
    wide_slots = [0, 1, 2] * 4
    batch = CpuLoRABatch(slots, wide_slots, SchedulerOutput(), stacks)
    x = torch.randn(len(wide_slots), lin.in_features)
    args = batch.native.fused(ks, x, lin.out_features)
    assert args is not None and lin.lora_forward(x, args) is None  # 12 rows: the dense copy
    want = lin(x)
    batch.apply(4, "o", x, want)
    assert torch.equal(batch.linear(4, "o", lin, x), want)

    batch = CpuLoRABatch(slots, [0, 1], SchedulerOutput(), stacks)
    x = torch.randn(2, lin.in_features)
    assert batch.native.fused(ks, x.double(), lin.out_features) is None
    assert batch.native.fused(ks, x.t().contiguous().t(), lin.out_features) is None
    assert batch.native.fused(ks, x, 16) is None
    assert batch.native.fused(ks, x[:1].contiguous(), lin.out_features) is None  # another token count

    ranks = slots.stacks[(4, "o")].ranks
    saved = ranks.clone()
    try:
        ranks[1] = 65  # past the stacks' rank 64: a bug, never a tenant's input
        with pytest.raises(RuntimeError, match="rank outside the stack"):
            batch.linear(4, "o", lin, x)
    finally:
        ranks.copy_(saved)


def test_a_step_that_prefills_on_the_exact_copy_makes_the_two_calls(amx_layer_linears):
    """With AMX and the exact fp32 copy for steps that prefill (EngineConfig.exact_prefill),
    a prefill step's rows past the int8 band take that copy, which has no fused entry: the two
    calls, lin(x) plus the term; the same rows in a decode step take the AMX kernel's fused entry."""
    linears, slots = amx_layer_linears
    stacks = kernel_stacks_of(slots)
    lin, ks = linears["qkv"], stacks[4]["qkv"][1]
    token_slots = [-1, 0, 0, 1, 2, 2]
    batch = CpuLoRABatch(slots, token_slots, SchedulerOutput(), stacks)
    x = torch.randn(len(token_slots), lin.in_features)
    args = batch.native.fused(ks, x, lin.out_features)
    try:
        lin.step.prefills = True
        assert lin.lora_forward(x, args) is None
        want = lin(x)  # the fp32 copy
        batch.apply(4, "qkv", x, want)
        assert torch.equal(batch.linear(4, "qkv", lin, x), want)
    finally:
        lin.step.prefills = False
    assert lin.lora_forward(x, args) is not None
    assert not torch.equal(batch.linear(4, "qkv", lin, x), want)  # the AMX kernel's bf16 product


def _answers(engine, tokenizer) -> dict:
    """Greedy tokens and their logprobs: each adapter and the base alone (one row a step: the
    Q4_1 kernel), then all of them in one batch (the int8 kernel)."""
    prompts = ["Name three colors.", "What is 2 + 3?"]
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=0)
    out = {}
    for a in (None, *ADAPTERS):
        r = GenerationRequest(f"alone-{a}", prompt=chat(tokenizer, prompts[0]), adapter=a, params=params)
        o = engine.generate([r])[r.request_id]
        out[("alone", a)] = (o.token_ids, [lp["logprob"] for lp in o.logprobs])
    reqs = [GenerationRequest(f"mixed-{a}-{i}", prompt=chat(tokenizer, p), adapter=a, params=params)
            for a in (None, *ADAPTERS) for i, p in enumerate(prompts)]
    outs = engine.generate(reqs)
    for r in reqs:
        o = outs[r.request_id]
        out[r.request_id] = (o.token_ids, [lp["logprob"] for lp in o.logprobs])
    return out


def test_an_engine_with_fused_linears_answers_exactly_as_one_without(make_engine, tokenizer, monkeypatch):
    """Two int8-format engines on the demo adapters, fused linears on and off: the same greedy
    tokens and the same logprobs, to the bit; and the fused one did take both fused entries."""
    require_c_compiler()
    if cpu_q4.library() is None or cpu_int8.library() is None:
        pytest.skip("no C int8 or Q4_1 kernel on this CPU")
    taken = {"int8": 0, "amx": 0, "q4": 0}

    def count(key, fn):
        def wrapped(*a, lora=None):
            taken[key] += lora is not None
            return fn(*a, lora=lora)
        return wrapped

    monkeypatch.setattr(cpu_int8, "int8_linear", count("int8", cpu_int8.int8_linear))
    monkeypatch.setattr(cpu_int8, "int8_linear_amx", count("amx", cpu_int8.int8_linear_amx))
    monkeypatch.setattr(cpu_q4, "q4_linear", count("q4", cpu_q4.q4_linear))

    def start(fused: bool):
        return make_engine(LocalDirectoryAdapterSource(DEMO), weight_format="auto", max_loras=len(ADAPTERS),
                           max_lora_rank=64, kv_cache_bytes=32 << 20, cpu_fused_lora=fused)

    plain_engine = start(False)
    plain = _answers(plain_engine, tokenizer)
    assert taken == {"int8": 0, "amx": 0, "q4": 0}
    fused = _answers(start(True), tokenizer)
    # the mixed batch's 8 rows: the AMX kernel where the format choice packed it, else the int8 kernel
    wide = "amx" if any(isinstance(m, AmxInt8Linear) for m in plain_engine.model.modules()) else "int8"
    assert taken[wide] > 0 and taken["q4"] > 0
    assert fused == plain
    assert any(plain[("alone", a)][0] != plain[("alone", None)][0] for a in ADAPTERS)  # the adapters took part
