"""Backend.gated_linear, the MLP's down projection of a gate | up block: every backend gives
linear(act_mul(gu, act)); the Triton backend gives it in one kernel (the linear's `forward_gated`)
for a one-row step on its 4- and 8-bit linears, and materializes the activation otherwise (wider
steps, dense linears). Runs the Triton kernels on CPU tensors under the interpreter (see
tests/conftest.py); the whole engine's parity is tests/engine/test_backend_parity.py."""
from __future__ import annotations

import pytest
import torch

from engine.backends import create_backend
from engine.backends.triton import w4a16, w8a16
from engine.config import EngineConfig
from engine.loader.quantized import QuantizedWeight


def _backend(name: str):
    from punica_kernels.kernels._common import INTERPRETED

    if name == "triton" and not INTERPRETED:
        pytest.skip("the Triton backend on CPU tensors needs the interpreter")
    return create_backend(EngineConfig(backend=name, device="cpu", weight_format="auto" if name == "triton" else "fp32"))


def _linears(backend) -> dict[str, torch.nn.Module]:
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(24, 64, generator=gen) * 0.1
    codes = torch.randint(-128, 128, (24, 64), generator=gen).to(torch.int8)
    q8 = QuantizedWeight(8, codes, torch.rand(24, 2, generator=gen) * 1e-2, None, 32, source="test q8")
    return {"w4a16": backend.linear([dense]), "w8a16": backend.linear([q8]),
            "dense": backend.linear([torch.randn(24, 48, generator=gen)])}  # K % 32 != 0: kept dense


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows", [1, 3])
def test_triton_gated_linear_fuses_one_row_steps(act, rows, monkeypatch):
    be = _backend("triton")
    lins = _linears(be)
    assert isinstance(lins["w4a16"], w4a16.W4A16Linear) and isinstance(lins["w8a16"], w8a16.W8A16Linear)
    fused = []  # the classes whose one-kernel path ran, in call order

    def spy(cls):
        original = cls.forward_gated

        def forward_gated(self, gu, a):
            fused.append(cls)
            return original(self, gu, a)
        return forward_gated

    for cls in (w4a16.W4A16Linear, w8a16.W8A16Linear):
        monkeypatch.setattr(cls, "forward_gated", spy(cls))
    gen = torch.Generator().manual_seed(rows)
    for name, lin in lins.items():
        gu = torch.randn(rows, 2 * lin.in_features, generator=gen) * 3
        assert torch.equal(be.gated_linear(lin, gu, act), lin(be.act_mul(gu, act))), name
    assert fused == ([w4a16.W4A16Linear, w8a16.W8A16Linear] if rows <= w4a16.GATED_MAX_M else [])


def test_default_gated_linear_is_the_activation_then_the_linear():
    be = _backend("cpu")
    lin = be.linear([torch.randn(24, 64, generator=torch.Generator().manual_seed(1))])
    gu = torch.randn(2, 128, generator=torch.Generator().manual_seed(2))
    assert torch.equal(be.gated_linear(lin, gu, "silu"), lin(be.act_mul(gu, "silu")))
    with pytest.raises(ValueError, match="activation"):
        be.gated_linear(lin, gu, "relu")
