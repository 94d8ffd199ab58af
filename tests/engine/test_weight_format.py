"""int8 weight-only layers: the int8/dense crossover is measured on the loaded weights, and each
batch size takes the path the measurement chose."""
from __future__ import annotations

import torch

from engine.model.layers import BaseLinear, calibrate_int8_rows


def test_calibration_sets_a_measured_threshold_that_forward_follows():
    g = torch.Generator().manual_seed(0)
    layers = [BaseLinear(torch.randn(256, 128, generator=g), "int8"),
              BaseLinear(torch.randn(128, 256, generator=g), "int8")]
    rows = calibrate_int8_rows(layers, candidates=(1, 2, 4, 8, 16, 32))
    assert rows in (0, 1, 2, 4, 8, 16, 32)
    assert all(layer.int8_max_rows == rows for layer in layers)
    layer = layers[0]
    for m in (1, 8, 33):
        x = torch.randn(m, 128, generator=g)
        int8 = torch._weight_int8pack_mm(x.bfloat16(), layer.weight, layer.scales).float()
        dense = torch.nn.functional.linear(x, layer.dense)
        want = int8 if m <= rows else dense
        assert torch.equal(layer(x), want)


def test_calibration_of_nothing_is_a_no_op():
    assert calibrate_int8_rows([]) == 0
