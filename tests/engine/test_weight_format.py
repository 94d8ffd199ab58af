"""Base weight formats: int8 weight-only layers with a dense copy whose dtype (fp32 or bf16) and
int8/dense crossover are measured on the loaded weights, and each batch size takes the path the
measurement chose. The exact fp32 format stays available (tests/engine/test_model_vs_hf.py)."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import pick_weight_format
from engine.model.layers import BaseLinear, calibrate_int8_rows, choose_dense_dtype


def _layers(g):
    return [BaseLinear(torch.randn(256, 128, generator=g), "int8"),
            BaseLinear(torch.randn(128, 256, generator=g), "int8")]


@pytest.mark.parametrize("dense", [torch.float32, torch.bfloat16], ids=str)
def test_calibration_sets_a_measured_threshold_that_forward_follows(dense):
    g = torch.Generator().manual_seed(0)
    layers = _layers(g)
    for layer in layers:
        layer.set_dense_dtype(dense)
    rows = calibrate_int8_rows(layers, candidates=(1, 2, 4, 8, 16, 32))
    assert rows in (0, 1, 2, 4, 8, 16, 32)
    assert all(layer.int8_max_rows == rows for layer in layers)
    layer = layers[0]
    for m in (1, 8, 33):
        x = torch.randn(m, 128, generator=g)
        int8 = torch._weight_int8pack_mm(x.bfloat16(), layer.weight, layer.scales).float()
        wide = torch.nn.functional.linear(x.to(dense), layer.dense).float()
        want = int8 if m <= rows else wide
        got = layer(x)
        assert got.dtype == torch.float32
        assert torch.equal(got, want)


def test_dense_dtype_choice_is_one_of_the_candidates_and_is_applied():
    g = torch.Generator().manual_seed(1)
    layers = _layers(g)
    ref = [layer.dense.clone() for layer in layers]
    dtype, timings = choose_dense_dtype(layers, rows=16, reps=2)
    assert dtype in (torch.float32, torch.bfloat16)
    assert set(timings) == {"float32", "bfloat16"} and all(t > 0 for t in timings.values())
    for layer, w in zip(layers, ref):
        assert layer.dense.dtype == dtype and layer.dense.is_contiguous()
        # Whatever was chosen, the wide path stays within bf16 rounding of the fp32 weights.
        x = torch.randn(40, layer.in_features, generator=g)
        torch.testing.assert_close(layer(x), x @ w.T, rtol=2e-2, atol=2e-2 * float((x @ w.T).abs().max()))


def test_a_forced_candidate_list_decides_the_dtype():
    layers = _layers(torch.Generator().manual_seed(2))
    dtype, _ = choose_dense_dtype(layers, rows=8, reps=1, candidates=(torch.bfloat16,))
    assert dtype == torch.bfloat16 and all(layer.dense.dtype == torch.bfloat16 for layer in layers)
    with pytest.raises(ValueError, match="int8"):
        BaseLinear(torch.randn(8, 8), "fp32").set_dense_dtype(torch.bfloat16)


def test_auto_is_int8_on_cpu_and_explicit_formats_are_kept():
    assert pick_weight_format(EngineConfig()) == "int8"
    for fmt in ("fp32", "bf16", "int8"):
        assert pick_weight_format(EngineConfig(weight_format=fmt)) == fmt


def test_calibration_of_nothing_is_a_no_op():
    assert calibrate_int8_rows([]) == 0
    assert choose_dense_dtype([]) == (torch.float32, {})


def test_auto_engine_greedy_output_stays_close_to_the_exact_engine(make_engine, tokenizer):
    """The measured format (int8 for decode, fp32 or bf16 for wide batches) is not exact, but a
    short greedy answer must still read the same as the fp32 engine's for a factual prompt."""
    from .conftest import chat
    from .helpers import greedy

    prompt = chat(tokenizer, "What is the capital of France?")
    fast = make_engine(weight_format="auto")
    assert fast.weight_format == "int8" and fast.int8_max_rows is not None
    out = fast.generate([greedy("auto", prompt, 16)])["auto"]
    assert "Paris" in out.text
