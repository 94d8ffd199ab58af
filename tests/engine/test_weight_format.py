"""Base weight formats on the CPU: one immutable module per format (engine.backends.cpu.linear),
the int8 format a WidthDispatch composed of them by CpuBackend.prepare_model (by the CPU's rules,
engine.backends.cpu.formats; the calibration tool measures the same crossovers). Int8 layers serve
decode-sized batches from int8 (or the checkpoint's Q4_1 blocks), wider ones from a dense copy (or
the AMX kernel), and steps that prefill from the exact fp32 copy where the choice keeps one. The
exact fp32 format stays available and tested against transformers (tests/engine/test_model_vs_hf.py)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.backends.cpu import CpuBackend, formats
from engine.backends.cpu import int8 as cpu_int8
from engine.backends.cpu.calibration import calibrate_int8_rows, calibrate_q4_rows, choose_dense_dtype
from engine.backends.cpu.linear import (AmxInt8Linear, DenseLinear, Int8KernelLinear, Int8Parts, Int8TorchLinear,
                                        PendingInt8Linear, Q4Linear, StepKind, WidthDispatch, compose_int8,
                                        onednn_packing)
from engine.config import EngineConfig
from engine.model.attention import AttentionMetadata, PrefillChunk
from tests.requirements import require_c_compiler

PLAIN = Int8Parts(int8_kernel=False, amx_kernel=False, q4_kernel=False, onednn=False)


def _pending(g):
    return [PendingInt8Linear(torch.randn(256, 128, generator=g)), PendingInt8Linear(torch.randn(128, 256, generator=g))]


def _compose(layer, parts=PLAIN, *, int8_max_rows=4, q4_max_rows=0, dense=torch.float32, exact_prefill=True,
             step=None):
    return compose_int8(layer, parts, int8_max_rows=int8_max_rows, q4_max_rows=q4_max_rows, dense=dense,
                        exact_prefill=exact_prefill, step=step or StepKind())


@pytest.mark.parametrize("dense", [torch.float32, torch.bfloat16], ids=str)
def test_a_width_dispatch_serves_each_batch_from_its_band(dense):
    """Up to the int8 crossover the int8 weights, past it the dense copy in its dtype in decode
    steps and the fp32 copy in steps that prefill; one dense module where the dtypes agree."""
    g = torch.Generator().manual_seed(0)
    layer = _pending(g)[0]
    step = StepKind()
    lin = _compose(layer, int8_max_rows=8, dense=dense, step=step)
    assert (lin.prefill is None) == (dense == torch.float32)  # the fp32 copy serves both
    int8 = Int8TorchLinear(layer.q, layer.scales)
    for m in (1, 8, 9, 33):
        x = torch.randn(m, 128, generator=g)
        wide = torch.nn.functional.linear(x.to(dense), layer.dense.to(dense)).float()
        got = lin(x)
        assert got.dtype == torch.float32
        assert torch.equal(got, int8(x) if m <= 8 else wide)
        step.prefills = True
        assert torch.equal(lin(x), int8(x) if m <= 8 else torch.nn.functional.linear(x, layer.dense))
        step.prefills = False
    assert torch.equal(lin.dequantized(), int8.dequantized())


def test_the_backend_marks_steps_that_prefill_for_its_linears():
    backend = CpuBackend(EngineConfig(weight_format="int8"))
    lin = _compose(_pending(torch.Generator().manual_seed(5))[0], int8_max_rows=0, dense=torch.bfloat16,
                   step=backend.step)
    x = torch.randn(3, 128)
    decode = AttentionMetadata(slot_mapping=torch.arange(3), num_decode=3, decode_slots=None, decode_mask=None,
                               prefills=[])
    prefill = dataclasses.replace(decode, num_decode=0, prefills=[PrefillChunk(0, 3, 3, None, None)])
    backend.begin_step(prefill)
    assert torch.equal(lin(x), lin.prefill(x))
    backend.begin_step(decode)
    assert torch.equal(lin(x), lin.wide(x)) and not torch.equal(lin(x), lin.prefill(x))


@pytest.mark.parametrize("dense", [torch.float32, torch.bfloat16], ids=str)
def test_packed_dense_copies_give_the_plain_weights_results(dense):
    """oneDNN-blocked copies change speed, not results: they match F.linear on the plain weight at
    every row count (the packing is blocked for 32 rows; any count must work), and keep no plain
    copy beside them."""
    if not onednn_packing():
        pytest.skip("this torch build has no oneDNN weight packing")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(128, 256, generator=g)
    plain, packed = DenseLinear(w, dense), DenseLinear(w, dense, pack=True)
    assert packed.packed and [b.dtype for b in packed.buffers()] == [dense]
    with pytest.raises(ValueError, match="packed"):
        packed.dequantized()
    for m in (1, 3, 31, 32, 33, 100):
        x = torch.randn(m, 256, generator=g)
        # fp32: same math, another summation order (~1e-6 relative); bf16: the same kernel.
        tol = dict(rtol=1e-5, atol=1e-4) if dense == torch.float32 else dict(rtol=1e-2, atol=2e-2)
        torch.testing.assert_close(packed(x), plain(x), **tol)
        assert packed(x).dtype == torch.float32


def test_int8_kernel_gives_the_quantized_weights_product():
    """The C int8 kernel multiplies by exactly the quantized weights (int8 x bf16 scales) in fp32,
    where torch's kernel rounds the activations to bf16. Shapes that are not multiples of 16 keep
    torch's kernel."""
    g = torch.Generator().manual_seed(4)
    layer = PendingInt8Linear(torch.randn(96, 160, generator=g))
    require_c_compiler()
    parts = dataclasses.replace(PLAIN, int8_kernel=True)
    assert parts.int8(layer), "the int8 kernel did not build although a C compiler is here"
    kernel, torch_path = Int8KernelLinear(layer.q, layer.scales), Int8TorchLinear(layer.q, layer.scales)
    assert kernel.blocked.dtype == torch.int8 and kernel.blocked.numel() == layer.q.numel()
    assert torch.equal(kernel.dequantized(), torch_path.dequantized())  # the blocked copy holds the same weights
    w = torch_path.dequantized().double()
    for m in (1, 2, 4):
        x = torch.randn(m, 160, generator=g)
        want = x.double() @ w.T
        got, tp = kernel(x), torch_path(x)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
        # torch's kernel (bf16 activations) agrees to bf16 rounding, and is less exact.
        torch.testing.assert_close(tp.double(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
        assert (got.double() - want).abs().max() <= (tp.double() - want).abs().max()
    composed = _compose(layer, parts)
    assert isinstance(composed.bands[-1][1], Int8KernelLinear)
    odd = PendingInt8Linear(torch.randn(40, 24))  # not 16-aligned
    assert not parts.int8(odd) and isinstance(_compose(odd, parts).bands[-1][1], Int8TorchLinear)


@pytest.mark.skipif(cpu_int8.amx_library() is None, reason="no AMX on this CPU (or no C compiler)")
def test_amx_kernel_gives_the_quantized_weights_product_for_wide_decode_batches():
    """On CPUs with AMX, decode batches past the int8 crossover multiply by the int8 weights
    themselves on the tile unit: bf16 activations, exact int8 weights and fp32 scales, fp32
    accumulation. Steps that prefill (exact_prefill) keep the fp32 copy."""
    g = torch.Generator().manual_seed(6)
    layer = PendingInt8Linear(torch.randn(96, 160, generator=g))
    parts = Int8Parts(int8_kernel=True, amx_kernel=True, q4_kernel=False, onednn=False)
    assert parts.amx(layer)
    step = StepKind()
    lin = _compose(layer, parts, int8_max_rows=4, dense=torch.bfloat16, step=step)
    assert isinstance(lin.wide, AmxInt8Linear) and lin.wide.tiled.numel() == layer.q.numel()
    w = lin.dequantized().double()
    assert torch.equal(lin.wide.dequantized(), lin.dequantized())
    for m in (5, 16, 33, 64, 70):  # partial 16-row tiles, and more than one 64-row chunk
        x = torch.randn(m, 160, generator=g)
        want = x.bfloat16().double() @ w.T
        got = lin(x)
        assert got.dtype == torch.float32 and got.shape == (m, 96)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        # closer to the fp32 product than a bf16 dense copy would be
        exact = x.double() @ w.T
        bf16 = DenseLinear(layer.dense, torch.bfloat16)(x).double()
        assert (got.double() - exact).abs().max() < (bf16 - exact).abs().max()
        step.prefills = True
        torch.testing.assert_close(lin(x), x @ layer.dense.T, rtol=1e-5, atol=1e-4)
        step.prefills = False
    assert not parts.amx(PendingInt8Linear(torch.randn(32, 48)))  # 48 inputs: the FMA kernel's, not AMX's


def test_dense_dtype_choice_is_one_of_the_candidates():
    layers = _pending(torch.Generator().manual_seed(1))
    dtype, timings = choose_dense_dtype(layers, rows=16, reps=2)
    assert dtype in (torch.float32, torch.bfloat16)
    assert set(timings) == {"float32", "bfloat16"} and all(t > 0 for t in timings.values())
    dtype, _ = choose_dense_dtype(layers, rows=8, reps=1, candidates=(torch.bfloat16,))
    assert dtype == torch.bfloat16


def test_calibration_returns_a_measured_crossover():
    layers = _pending(torch.Generator().manual_seed(2))
    for dense in (torch.float32, torch.bfloat16):
        assert calibrate_int8_rows(layers, PLAIN, dense, candidates=(1, 2, 4, 8), reps=1) in (0, 1, 2, 4, 8)


def test_auto_is_int8_on_cpu_and_explicit_formats_are_kept():
    assert CpuBackend(EngineConfig()).weight_format() == "int8"
    for fmt in ("fp32", "bf16", "int8"):
        assert CpuBackend(EngineConfig(weight_format=fmt)).weight_format() == fmt
    backend = CpuBackend(EngineConfig(weight_format="bf16"))
    lin = backend.linear([torch.randn(16, 32)])
    assert isinstance(lin, DenseLinear) and lin.dtype == torch.bfloat16


def test_calibration_of_nothing_is_a_no_op():
    assert calibrate_int8_rows([], PLAIN, torch.float32) == 0
    assert calibrate_q4_rows([PendingInt8Linear(torch.randn(32, 64))], PLAIN) == 0  # no Q4_1 blocks kept
    assert choose_dense_dtype([]) == (torch.float32, {})


def _exact_and_int8(smollm_checkpoint, *, amx: bool = False, **choice):
    """The checkpoint as the exact fp32 model and as the int8 model composed by a choice with
    `choice`'s fields (the rules' choice for this CPU otherwise)."""
    from engine.model.decoder import DecoderModel

    cfg, weights, _ = smollm_checkpoint
    exact = DecoderModel(cfg, weights, backend=CpuBackend(EngineConfig(weight_format="fp32")))
    backend = CpuBackend(EngineConfig(weight_format="int8"))
    fast = DecoderModel(cfg, weights, backend=backend)
    with pytest.raises(RuntimeError, match="prepare_model"):
        fast.lm_head(torch.zeros(1, cfg.hidden_size))
    rules = formats.choose_formats(formats.detect_cpu(), int8_kernel=True, amx_kernel=amx, q4_kernel=True)
    parts = dataclasses.replace(backend.int8_parts(), amx_kernel=amx)
    backend.apply_formats(fast, dataclasses.replace(rules, **choice), parts)
    assert not any(isinstance(m, PendingInt8Linear) for m in fast.modules())
    return exact, fast


@pytest.mark.parametrize("path", ["wide", "int8"])
def test_fast_formats_stay_close_to_the_exact_model(smollm_checkpoint, tokenizer, path):
    """The int8 format is not exact (bf16 or int8 weights, bf16 matmul outputs), so it is held to
    a looser bound than the fp32 path's 1e-3 against transformers: logits within 8% of the
    largest, and where its argmax differs from the exact model's, it picks a near-tie (the exact
    model rates it within 0.5 of its best). Both paths are forced for every batch size and kind
    of step: the dense copy in bf16 ("wide"; the model would take it only in decode-only
    steps), or int8 ("int8")."""
    from .conftest import chat
    from .test_model_vs_hf import _our_logits

    rows = 0 if path == "wide" else 1 << 20
    exact, fast = _exact_and_int8(smollm_checkpoint, int8_max_rows=rows, head_int8_max_rows=rows, q4_max_rows=0,
                                  dense=torch.bfloat16, exact_prefill=False)
    for text in ("What is the capital of France?", "Write a haiku about the sea.", "2 + 2 ="):
        ids = tokenizer.encode(chat(tokenizer, text))
        ref, got = _our_logits(exact, ids), _our_logits(fast, ids)
        rel = float((got - ref).abs().max() / ref.abs().max())
        assert rel < 8e-2, f"{text!r}: relative error {rel:.3f}"
        gap = ref.max(-1).values - ref.gather(1, got.argmax(-1, keepdim=True)).squeeze(1)
        assert float(gap.max()) < 0.5, f"{text!r}: picks a token {float(gap.max()):.2f} below the best"
        assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.9


def test_a_prefill_step_on_the_auto_format_keeps_the_exact_first_token(smollm_checkpoint, tokenizer):
    """Steps that prefill multiply wide batches by the fp32 copy, so a prompt's logits (and first
    token) match the exact model's up to the int8 lm_head for few rows."""
    from .conftest import chat
    from .test_model_vs_hf import _our_logits

    exact, auto = _exact_and_int8(smollm_checkpoint, int8_max_rows=16, head_int8_max_rows=16,
                                  dense=torch.bfloat16, exact_prefill=True)
    ids = tokenizer.encode(chat(tokenizer, "What is the capital of France?"))
    assert len(ids) > 16
    ref, got = _our_logits(exact, ids), _our_logits(auto, ids)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-3 * float(ref.abs().max()))


def test_fast_prefill_keeps_the_first_tokens_of_the_test_prompts(smollm_checkpoint, tokenizer):
    """Where the engine runs prefill on the bf16 copy (exact_prefill False: chosen where its GEMMs
    measure >= FAST_PREFILL_MIN_SPEEDUP times fp32's), a prompt's logits, the lm_head's included,
    stay within the fast formats' bound, and its first greedy token is the exact model's or, on
    the near-tie "capital of France" prompt, one the exact model rates within 0.5 of its best
    (bf16 rounding there can flip it: why only AMX's speedup pays for it)."""
    from .conftest import chat
    from .test_model_vs_hf import _our_logits

    exact, fast = _exact_and_int8(smollm_checkpoint, int8_max_rows=16, head_int8_max_rows=16,
                                  dense=torch.bfloat16, exact_prefill=False)
    for text in ("What is the capital of France?", "What is the capital of Germany?", "2 + 2 ="):
        ids = tokenizer.encode(chat(tokenizer, text))
        ref, got = _our_logits(exact, ids), _our_logits(fast, ids)
        assert not torch.equal(got, ref)  # it did take the bf16 copy
        assert float((got - ref).abs().max() / ref.abs().max()) < 8e-2
        first = int(got[-1].argmax())
        if "France" in text:
            assert float(ref[-1].max() - ref[-1, first]) < 0.5, text
        else:
            assert first == int(ref[-1].argmax()), text


def test_engine_picks_the_prefill_copy_by_the_cpus_kind_or_by_config(smollm_checkpoint, tokenizer):
    """Steps that prefill leave the exact fp32 copy only on CPUs with AMX (bf16 GEMMs far faster
    there), unless EngineConfig.exact_prefill says; the choice is in the engine's log line, and
    the composed layers keep only the copies it reads."""
    from engine.llm_engine import LLMEngine

    def make(**kw):
        return LLMEngine(config=EngineConfig(kv_cache_bytes=16 << 20, **kw), checkpoint=smollm_checkpoint,
                         tokenizer=tokenizer)

    by_rule = make()
    cpu = formats.detect_cpu()
    assert by_rule.backend.exact_prefill == (not cpu.amx)
    wide = "int8 on AMX" if by_rule.backend.formats.amx_kernel else "bf16"
    assert by_rule.format_timings["summary"].endswith(
        "fp32 in steps that prefill" if by_rule.backend.exact_prefill else f"{wide} in steps that prefill")
    layers = [m for m in by_rule.model.modules() if isinstance(m, WidthDispatch)]
    assert len(layers) == 4 * by_rule.model_config.num_layers + 1
    dense = formats.dense_dtype(cpu)
    for lin in layers:
        parts = [m for _, m in lin.bands] + [lin.wide] + ([lin.prefill] if lin.prefill is not None else [])
        dense_parts = [m for m in parts if isinstance(m, DenseLinear)]
        assert len({m.dtype for m in dense_parts}) == len(dense_parts)  # no copy twice
        # a separate prefill copy only where it differs from the wide path's
        assert (lin.prefill is not None) == (by_rule.backend.exact_prefill and not (
            isinstance(lin.wide, DenseLinear) and lin.wide.dtype == torch.float32))
        assert isinstance(lin.wide, AmxInt8Linear) or lin.wide.dtype == dense
    assert make(exact_prefill=True).backend.exact_prefill is True
    assert make(exact_prefill=False).backend.exact_prefill is False


def test_gguf_q4_1_layers_stay_quantized_in_the_weights_order(smollm_checkpoint):
    """The loader keeps each Q4_1 layer weight as the file's codes and scales (a QuantizedWeight),
    rows permuted like the weights (Q/K un-permuted into HF's layout): its Q4_1 blocks are the
    file's, and they dequantize to the weights the file describes; the Q8_0 embedding is fp32."""
    from engine.backends.cpu import q4 as cpu_q4
    from engine.loader.gguf_quants import q4_1_blocks
    from engine.loader.quantized import QuantizedWeight

    _, weights, _ = smollm_checkpoint
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.3.mlp.down_proj.weight"):
        w = weights[name]
        assert isinstance(w, QuantizedWeight) and (w.bits, w.group_size, w.scales.dtype) == (4, 32, torch.float16)
        raw = torch.from_numpy(q4_1_blocks(w))
        assert raw.dtype == torch.uint8 and raw.shape == (w.N, w.K // 32 * 20)
        assert torch.equal(cpu_q4.dequantize(raw), w.dequantize())
    embed = weights["model.embed_tokens.weight"]
    assert isinstance(embed, torch.Tensor) and embed.dtype == torch.float32  # Q8_0 in this file


def test_q4_kernel_multiplies_by_the_files_own_weights_and_small_batches_take_it(smollm_checkpoint):
    """Where the checkpoint is Q4_1, the int8 format's smallest batches read those 4-bit blocks:
    the product with exactly the fp32 weights (no int8 re-quantization), fused projections
    included; wider batches take the int8 kernel, and past its crossover the wide path. The
    lm_head (tied Q8_0 embeddings) has no Q4_1 blocks."""
    from engine.backends.cpu import q4 as cpu_q4
    from engine.model.decoder import DecoderModel

    require_c_compiler()
    if cpu_q4.library() is None:
        pytest.skip("no Q4_1 kernel on this CPU (neither AVX-512 nor AVX2)")
    cfg, weights, _ = smollm_checkpoint
    backend = CpuBackend(EngineConfig(weight_format="int8"))
    model = DecoderModel(cfg, weights, backend=backend)
    parts = dataclasses.replace(backend.int8_parts(), amx_kernel=False)
    g = torch.Generator().manual_seed(9)
    for layer in (model.layers[0].qkv_proj, model.layers[5].gate_up_proj, model.layers[7].down_proj):
        assert parts.q4(layer)
        lin = _compose(layer, parts, int8_max_rows=4, q4_max_rows=3)
        assert [type(m) for _, m in lin.bands] == [Q4Linear, Int8KernelLinear]
        for m in (1, 2, 3):
            x = torch.randn(m, layer.in_features, generator=g)
            want = x.double() @ layer.dense.double().T  # the dequantized GGUF weights
            torch.testing.assert_close(lin(x).double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        x = torch.randn(4, layer.in_features, generator=g)  # past q4_max_rows: the int8 kernel
        assert torch.equal(lin(x), Int8KernelLinear(layer.q, layer.scales)(x))
        x = torch.randn(5, layer.in_features, generator=g)  # past int8_max_rows: the wide path
        assert torch.equal(lin(x), lin.wide(x))
    assert model.lm_head.q4_1 is None and not parts.q4(model.lm_head)


def test_q4_calibration_returns_a_measured_crossover(smollm_checkpoint):
    """Whether single rows (or a few) read the Q4_1 blocks is measured against the int8 kernel."""
    from engine.backends.cpu import q4 as cpu_q4
    from engine.model.decoder import DecoderModel

    require_c_compiler()
    if cpu_q4.library() is None:
        pytest.skip("no Q4_1 kernel on this CPU (neither AVX-512 nor AVX2)")
    cfg, weights, _ = smollm_checkpoint
    backend = CpuBackend(EngineConfig(weight_format="int8"))
    model = DecoderModel(cfg, weights, backend=backend)
    layers = [model.layers[0].qkv_proj, model.layers[0].down_proj]
    assert calibrate_q4_rows(layers, backend.int8_parts(), candidates=(1, 2, 4), reps=2) in (0, 1, 2, 4)
