"""Base weight formats: int8 weight-only layers keep an fp32 dense copy (steps that prefill) and,
on CPUs with bf16 GEMMs, a bf16 one (decode-only wide batches); each batch takes the path set on
the layer (by the CPU's rules in the engine, engine.backends.cpu.formats; the calibration tool
that measures the same crossovers sets them too). The exact fp32 format stays available and tested
against transformers (tests/engine/test_model_vs_hf.py)."""
from __future__ import annotations

import functools

import pytest
import torch

from engine.config import EngineConfig
from engine.backends.cpu import CpuBackend
from engine.backends.cpu import int8 as cpu_int8
from engine.backends.cpu.calibration import calibrate_int8_rows, calibrate_q4_rows, choose_dense_dtype
from engine.backends.cpu.linear import CpuLinear
from tests.requirements import require_c_compiler


def _layers(g):
    return [CpuLinear(torch.randn(256, 128, generator=g), "int8"),
            CpuLinear(torch.randn(128, 256, generator=g), "int8")]


@pytest.mark.parametrize("dense", [torch.float32, torch.bfloat16], ids=str)
def test_calibration_sets_a_measured_threshold_that_forward_follows(dense):
    g = torch.Generator().manual_seed(0)
    layers = _layers(g)
    for layer in layers:
        layer.set_fast_dtype(dense)
    rows = calibrate_int8_rows(layers, candidates=(1, 2, 4, 8, 16, 32))
    assert rows in (0, 1, 2, 4, 8, 16, 32)
    assert all(layer.int8_max_rows == rows for layer in layers)
    layer = layers[0]
    for m in (1, 8, 33):
        x = torch.randn(m, 128, generator=g)
        int8 = layer.int8_linear(x)
        fast = layer.dense if layer.dense_fast is None else layer.dense_fast
        wide = torch.nn.functional.linear(x.to(dense), fast).float()
        assert fast.dtype == dense
        want = int8 if m <= rows else wide
        got = layer(x)
        assert got.dtype == torch.float32
        assert torch.equal(got, want)
        # Steps that prefill take the fp32 copy past the crossover.
        want_exact = int8 if m <= rows else torch.nn.functional.linear(x, layer.dense)
        assert torch.equal(layer(x, exact=True), want_exact)


@pytest.mark.parametrize("dense", [torch.float32, torch.bfloat16], ids=str)
def test_packed_dense_copies_give_the_plain_weights_results(dense):
    """oneDNN-blocked copies (pack_dense) change speed, not results: past the int8 crossover both
    the exact fp32 path and the fast path match F.linear on the plain copies, at every row count
    (the packing is blocked for 32 rows; any count must work)."""
    g = torch.Generator().manual_seed(3)
    layer = _layers(g)[1]
    layer.set_fast_dtype(dense)
    layer.int8_max_rows = 0
    plain = {exact: [] for exact in (True, False)}
    xs = [torch.randn(m, layer.in_features, generator=g) for m in (1, 3, 31, 32, 33, 100)]
    for x in xs:
        for exact in (True, False):
            plain[exact].append(layer(x, exact=exact))
    if not layer.pack_dense():
        pytest.skip("this torch build has no oneDNN weight packing")
    assert set(layer.packed) == {torch.float32, dense}
    for i, x in enumerate(xs):
        # fp32: same math, another summation order (~1e-6 relative); bf16: the same kernel.
        torch.testing.assert_close(layer(x, exact=True), plain[True][i], rtol=1e-5, atol=1e-4)
        tol = dict(rtol=1e-5, atol=1e-4) if dense == torch.float32 else dict(rtol=1e-2, atol=2e-2)
        torch.testing.assert_close(layer(x), plain[False][i], **tol)
        assert layer(x).dtype == torch.float32
    assert not CpuLinear(torch.randn(8, 8), "fp32").pack_dense()  # only the int8 format keeps dense copies


def test_int8_kernel_gives_the_quantized_weights_product_and_forward_takes_it():
    """The C int8 kernel (pack_int8) multiplies by exactly the quantized weights (int8 x bf16
    scales) in fp32, where torch's kernel rounds the activations to bf16; forward takes it for
    batches up to the crossover. Shapes that are not multiples of 16 keep torch's kernel."""
    g = torch.Generator().manual_seed(4)
    layer = CpuLinear(torch.randn(96, 160, generator=g), "int8")
    xs = [torch.randn(m, 160, generator=g) for m in (1, 2, 4)]
    torch_path = [layer.int8_linear(x) for x in xs]
    require_c_compiler()
    assert layer.pack_int8(), "the int8 kernel did not build although a C compiler is here"
    assert layer.int8_blocked.dtype == torch.int8 and layer.int8_blocked.numel() == layer.weight.numel()
    layer.int8_max_rows = 4
    w = layer.dequantized().double()
    for x, tp in zip(xs, torch_path):
        want = x.double() @ w.T
        got = layer(x)
        assert got.dtype == torch.float32 and torch.equal(got, layer.int8_linear(x))
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
        # torch's kernel (bf16 activations) agrees to bf16 rounding, and is less exact.
        torch.testing.assert_close(tp.double(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
        assert (got.double() - want).abs().max() <= (tp.double() - want).abs().max()
    assert not CpuLinear(torch.randn(40, 24), "int8").pack_int8()  # 40 x 24: not 16-aligned


@pytest.mark.skipif(cpu_int8.amx_library() is None, reason="no AMX on this CPU (or no C compiler)")
def test_amx_kernel_gives_the_quantized_weights_product_for_wide_decode_batches():
    """On CPUs with AMX, decode batches past the int8 crossover multiply by the int8 weights
    themselves on the tile unit: bf16 activations (as the bf16 dense copy rounds them), exact int8
    weights and fp32 scales, fp32 accumulation. Steps that prefill (exact) keep the fp32 copy."""
    g = torch.Generator().manual_seed(6)
    layer = CpuLinear(torch.randn(96, 160, generator=g), "int8")
    assert layer.pack_int8() and layer.int8_tiled is not None
    assert layer.int8_tiled.numel() == layer.weight.numel()
    layer.set_fast_dtype(torch.bfloat16)
    layer.int8_max_rows = 4
    w = layer.dequantized().double()
    for m in (5, 16, 33, 64, 70):  # partial 16-row tiles, and more than one 64-row chunk
        x = torch.randn(m, 160, generator=g)
        want = x.bfloat16().double() @ w.T
        got = layer(x)
        assert got.dtype == torch.float32 and got.shape == (m, 96)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        # closer to the fp32 product than the bf16 dense copy it replaces
        exact = x.double() @ w.T
        assert (got.double() - exact).abs().max() < (layer.dense_linear(x, exact=False).double() - exact).abs().max()
        torch.testing.assert_close(layer(x, exact=True), x @ layer.dense.T, rtol=1e-5, atol=1e-4)
    narrow = CpuLinear(torch.randn(32, 48), "int8")
    assert narrow.pack_int8() and narrow.int8_tiled is None  # 48 inputs: the FMA kernel's, not AMX's


def test_dense_dtype_choice_is_one_of_the_candidates_and_is_applied():
    g = torch.Generator().manual_seed(1)
    layers = _layers(g)
    ref = [layer.dense.clone() for layer in layers]
    dtype, timings = choose_dense_dtype(layers, rows=16, reps=2)
    assert dtype in (torch.float32, torch.bfloat16)
    assert set(timings) == {"float32", "bfloat16"} and all(t > 0 for t in timings.values())
    for layer, w in zip(layers, ref):
        assert torch.equal(layer.dense, w) and layer.dense.dtype == torch.float32  # the exact copy stays
        assert (layer.dense_fast is None) == (dtype == torch.float32)
        # Whatever was chosen, the wide path stays within bf16 rounding of the fp32 weights.
        layer.int8_max_rows = 0
        x = torch.randn(40, layer.in_features, generator=g)
        torch.testing.assert_close(layer(x), x @ w.T, rtol=2e-2, atol=2e-2 * float((x @ w.T).abs().max()))


def test_a_forced_candidate_list_decides_the_dtype():
    layers = _layers(torch.Generator().manual_seed(2))
    dtype, _ = choose_dense_dtype(layers, rows=8, reps=1, candidates=(torch.bfloat16,))
    assert dtype == torch.bfloat16 and all(layer.dense_fast.dtype == torch.bfloat16 for layer in layers)
    with pytest.raises(ValueError, match="int8"):
        CpuLinear(torch.randn(8, 8), "fp32").set_fast_dtype(torch.bfloat16)


def test_auto_is_int8_on_cpu_and_explicit_formats_are_kept():
    assert CpuBackend(EngineConfig()).weight_format() == "int8"
    for fmt in ("fp32", "bf16", "int8"):
        assert CpuBackend(EngineConfig(weight_format=fmt)).weight_format() == fmt


def test_calibration_of_nothing_is_a_no_op():
    assert calibrate_int8_rows([]) == 0
    assert calibrate_q4_rows([CpuLinear(torch.randn(32, 64), "int8")]) == 0  # no Q4_1 blocks kept
    assert choose_dense_dtype([]) == (torch.float32, {})


def _decode_forward(layer, x, exact=False):
    return CpuLinear.forward(layer, x, exact=False)


def _exact_and_fast(smollm_checkpoint, *, int8_max_rows: int, pack_dense=False, decode_only=False):
    """The checkpoint as the exact fp32 model and as the int8 model whose layers keep a bf16 dense
    copy (packed where pack_dense) and take int8 up to int8_max_rows rows; decode_only: every
    forward as in a decode-only step."""
    from engine.model.decoder import DecoderModel

    cfg, weights, _ = smollm_checkpoint
    exact = DecoderModel(cfg, weights, backend=CpuBackend(EngineConfig(weight_format="fp32")))
    fast = DecoderModel(cfg, weights, backend=CpuBackend(EngineConfig(weight_format="int8")))
    for m in fast.modules():
        if isinstance(m, CpuLinear):
            m.set_fast_dtype(torch.bfloat16)
            if pack_dense:
                m.pack_dense()
            m.int8_max_rows = int8_max_rows
            if decode_only:
                m.forward = functools.partial(_decode_forward, m)
    return exact, fast


@pytest.mark.parametrize("path", ["wide", "int8"])
def test_fast_formats_stay_close_to_the_exact_model(smollm_checkpoint, tokenizer, path):
    """The measured format is not exact (bf16 or int8 weights, bf16 matmul outputs), so it is held
    to a looser bound than the fp32 path's 1e-3 against transformers: logits within 8% of the
    largest, and where its argmax differs from the exact model's, it picks a near-tie (the exact
    model rates it within 0.5 of its best). Both paths are forced: the dense copy in bf16 for
    every batch size ("wide"; the model would take it only in decode-only steps), or int8 for
    every batch size ("int8")."""
    from .conftest import chat
    from .test_model_vs_hf import _our_logits

    exact, fast = _exact_and_fast(smollm_checkpoint, int8_max_rows=0 if path == "wide" else 1 << 20,
                                  decode_only=True)
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

    exact, auto = _exact_and_fast(smollm_checkpoint, int8_max_rows=16)
    ids = tokenizer.encode(chat(tokenizer, "What is the capital of France?"))
    assert len(ids) > 16
    ref, got = _our_logits(exact, ids), _our_logits(auto, ids)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-3 * float(ref.abs().max()))


def test_fast_prefill_keeps_the_first_tokens_of_the_test_prompts(smollm_checkpoint, tokenizer):
    """Where the engine runs prefill on the bf16 copy (exact_prefill False: chosen where its GEMMs
    measure >= FAST_PREFILL_MIN_SPEEDUP times fp32's), a prompt's logits stay within the fast
    formats' bound and its first greedy token is the exact model's, the near-tie
    "capital of France" prompt included."""
    from .conftest import chat
    from .test_model_vs_hf import _our_logits

    exact, fast = _exact_and_fast(smollm_checkpoint, int8_max_rows=16, pack_dense=True)
    fast.backend.exact_prefill = False
    for text in ("What is the capital of France?", "What is the capital of Germany?", "2 + 2 ="):
        ids = tokenizer.encode(chat(tokenizer, text))
        ref, got = _our_logits(exact, ids), _our_logits(fast, ids)
        assert not torch.equal(got, ref)  # it did take the bf16 copy
        assert float((got - ref).abs().max() / ref.abs().max()) < 8e-2
        assert int(got[-1].argmax()) == int(ref[-1].argmax()), text


def test_engine_picks_the_prefill_copy_by_the_cpus_kind_or_by_config(smollm_checkpoint, tokenizer):
    """Steps that prefill leave the exact fp32 copy only on CPUs with AMX (bf16 GEMMs far faster
    there), unless EngineConfig.exact_prefill says; the choice is in the engine's log line."""
    from engine.backends.cpu.formats import detect_cpu
    from engine.llm_engine import LLMEngine

    def make(**kw):
        return LLMEngine(config=EngineConfig(kv_cache_bytes=16 << 20, **kw), checkpoint=smollm_checkpoint,
                         tokenizer=tokenizer)

    by_rule = make()
    assert by_rule.backend.exact_prefill == (not detect_cpu().amx)
    assert by_rule.format_timings["summary"].endswith(
        "fp32 in steps that prefill" if by_rule.backend.exact_prefill else "bf16 in steps that prefill")
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
    included; wider batches take the int8 kernel, and past its crossover the wide path."""
    from engine.backends.cpu import int8 as cpu_int8, q4 as cpu_q4
    from engine.model.decoder import DecoderModel

    require_c_compiler()
    if cpu_q4.library() is None:
        pytest.skip("no Q4_1 kernel on this CPU (neither AVX-512 nor AVX2)")
    cfg, weights, _ = smollm_checkpoint
    model = DecoderModel(cfg, weights, backend=CpuBackend(EngineConfig(weight_format="int8")))
    g = torch.Generator().manual_seed(9)
    for layer in (model.layers[0].qkv_proj, model.layers[5].gate_up_proj, model.layers[7].down_proj):
        assert layer.pack_int8() and layer.q4_blocked is not None and layer.q4_1_raw is None
        layer.int8_max_rows = 4
        layer.q4_max_rows = 3
        for m in (1, 2, 3):
            x = torch.randn(m, layer.in_features, generator=g)
            want = x.double() @ layer.dense.double().T  # the dequantized GGUF weights
            got = layer(x)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        x = torch.randn(4, layer.in_features, generator=g)  # past q4_max_rows: the int8 kernel
        assert torch.equal(layer(x), cpu_int8.int8_linear(x, layer.int8_blocked, layer.int8_scales))
        x = torch.randn(5, layer.in_features, generator=g)  # past int8_max_rows: the wide path
        assert torch.equal(layer(x), layer.wide_linear(x, exact=False))
    assert model.lm_head.q4_1_raw is None  # tied Q8_0 embeddings: the int8 kernels serve the head


def test_q4_calibration_sets_a_measured_threshold_that_forward_follows(smollm_checkpoint):
    """Whether single rows (or a few) read the Q4_1 blocks is measured against the int8 kernel,
    and each batch then takes the kernel the measurement chose."""
    from engine.backends.cpu import q4 as cpu_q4
    from engine.model.decoder import DecoderModel

    require_c_compiler()
    if cpu_q4.library() is None:
        pytest.skip("no Q4_1 kernel on this CPU (neither AVX-512 nor AVX2)")
    cfg, weights, _ = smollm_checkpoint
    model = DecoderModel(cfg, weights, backend=CpuBackend(EngineConfig(weight_format="int8")))
    layers = [model.layers[0].qkv_proj, model.layers[0].down_proj]
    for layer in layers:
        assert layer.pack_int8()
    rows = calibrate_q4_rows(layers, candidates=(1, 2, 4))
    assert rows in (0, 1, 2, 4) and all(layer.q4_max_rows == rows for layer in layers)
    g = torch.Generator().manual_seed(3)
    layer = layers[0]
    for m in (1, 2, 4, 5):
        x = torch.randn(m, layer.in_features, generator=g)
        want = (cpu_q4.q4_linear(x, layer.q4_blocked) if m <= rows
                else cpu_int8.int8_linear(x, layer.int8_blocked, layer.int8_scales))
        assert torch.equal(layer.int8_linear(x), want)
